"""GPT-OSS's output format, harmony, read from the answer's text (special tokens kept): a run of
messages, each a header and a body,

    <|channel|>analysis<|message|>The user asks ...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>
    <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>

The first message's `<|start|>assistant` is the prompt's (the chat template ends with it). A
header names the channel (analysis: the reasoning; commentary: tool calls and preambles; final:
the answer) and may name a recipient (`to=functions.NAME`, in the role's part or the channel's)
and a content type (`<|constrain|>json`). A body ends at <|end|>, <|call|> (a tool call) or
<|return|> (the answer's end); the stop token itself may or may not be in the text.

The reading is of the text as far as it has arrived: the last message may be unfinished (its
body so far, minus what could be the start of an end marker), and its header may not be
complete yet. Text that is not harmony (no header where one must be) ends the messages: the rest
is `tail`, shown as content, never an error. This is the published format (the openai-harmony
library's), read here from text because that library's encoding downloads its vocabulary at load.
"""
import re
from dataclasses import dataclass

from .base import held_marker

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
FINAL_MARKER = CHANNEL + "final" + MESSAGE     # where an answer's final text starts
_MAX_HEADER = 256                               # a header longer than this is no header
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"([^\s<]*)")


@dataclass
class Message:
    channel: str | None
    recipient: str | None
    body: str              # as far as it has arrived (a partial end marker held back)
    complete: bool
    start: int             # where its text starts in the answer (its header included)
    end: int               # where it ends (after its end marker once complete)


@dataclass
class Reading:
    messages: list
    tail: str = ""         # text after the messages that is not harmony (shown as content)
    tail_at: int = -1      # where the tail starts (-1: none)


def _header(text: str) -> tuple[str | None, str | None] | None:
    """(channel, recipient) of a header's text, None when it is not a header."""
    if any(e in text for e in ENDS) or START in text[1:] or MESSAGE in text:
        return None
    m = _CHANNEL.search(text)
    r = _RECIPIENT.search(text)
    if m is None and r is None:
        return None
    return (m.group(1) if m else None), (r.group(1) if r else None)


def _could_be_header(text: str) -> bool:
    """Whether unfinished text (no <|message|> yet) may still become a header."""
    if len(text) > _MAX_HEADER or any(e in text for e in ENDS):
        return False
    head = text.lstrip()
    return any(p.startswith(head) or head.startswith(p) for p in (START, CHANNEL, " to=", "to="))


def read(text: str, final: bool) -> Reading:
    out = Reading([])
    i, first = 0, True
    while i < len(text):
        start = i
        if not first:
            if not text.startswith(START, i):
                if not final and START.startswith(text[i:]):
                    return out                           # "<|sta": the next message's start
                out.tail, out.tail_at = text[i:], i
                return out
        m = text.find(MESSAGE, i)
        header = text[i:m] if m >= 0 else text[i:]
        if m < 0:
            if not final and _could_be_header(header):
                return out                              # wait for the rest of the header
            out.tail, out.tail_at = text[i:], i
            return out
        parsed = _header(header)
        if parsed is None:
            out.tail, out.tail_at = text[i:], i
            return out
        body_at = m + len(MESSAGE)
        ends = [(text.find(e, body_at), e) for e in ENDS]
        ends = [(k, e) for k, e in ends if k >= 0]
        if ends:
            k, e = min(ends)
            out.messages.append(Message(*parsed, text[body_at:k], True, start, k + len(e)))
            i, first = k + len(e), False
            continue
        body = text[body_at:]
        if final:          # the stop token is not in the text: the body runs to the end
            out.messages.append(Message(*parsed, body, True, start, len(text)))
        else:
            keep = max(held_marker(body, e) for e in ENDS)
            out.messages.append(Message(*parsed, body[:len(body) - keep], False, start, len(text)))
        return out
    return out
