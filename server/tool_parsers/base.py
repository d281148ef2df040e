"""What every tool parser shares: a parsed output (content, calls), the reading of a call's JSON
object from a possibly unfinished text, and the streaming diff.

A parser reads the model's text as far as it has arrived (`parse(text, final)`) into the content
so far and the calls so far, each with its name once known and its arguments' raw JSON text as
far as it has arrived. Arguments are the model's own text of the JSON value (never re-serialized),
so what a stream sends as fragments is a prefix of what the finished text holds: the streamed
deltas, joined, are the non-streamed call. A call whose text is cut off or malformed is no call
at the end (non-streamed, its raw text is content, as vLLM answers a failed parse); a stream has
already sent what it read of it.
"""
import json
from dataclasses import dataclass, field

_DECODER = json.JSONDecoder()


@dataclass
class Call:
    name: str | None = None
    arguments: str = ""          # the raw JSON text so far (the whole value once complete)
    complete: bool = False
    raw: str = ""                # the call's text in the output (content, if it never completes)


@dataclass
class Parsed:
    content: str = ""
    calls: list[Call] = field(default_factory=list)


def held_marker(text: str, marker: str) -> int:
    """How many characters at the end of text could be the start of marker (kept back from the
    content until the next text tells)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def json_end(text: str, i: int) -> int | None:
    """The end of the JSON value starting at text[i], or None while it is unfinished or invalid."""
    try:
        _, end = _DECODER.raw_decode(text, i)
    except ValueError:
        return None
    return end


def _string_at(text: str, i: int) -> tuple[str, int] | None:
    if i >= len(text) or text[i] != '"':
        return None
    end = json_end(text, i)
    return None if end is None else (json.loads(text[i:end]), end)


def read_call_object(text: str, arg_keys=("arguments", "parameters")) -> Call:
    """A call written as {"name": ..., "arguments": {...}} (either key order; llama's
    "parameters"), from its text so far: the name once its string is complete, the arguments'
    raw text as far as it has come (a string-encoded arguments value is decoded once complete)."""
    call = Call(raw=text)
    i = skip_ws(text, 0)
    if i >= len(text) or text[i] != "{":
        return call
    i += 1
    args_span = None
    while True:
        i = skip_ws(text, i)
        if i < len(text) and text[i] == "}":
            call.complete = call.name is not None and args_span is not None and \
                json_end(text, skip_ws(text, 0)) is not None
            break
        key = _string_at(text, i)
        if key is None:
            break
        k, i = key
        i = skip_ws(text, i)
        if i >= len(text) or text[i] != ":":
            break
        i = skip_ws(text, i + 1)
        if i >= len(text):
            break
        end = json_end(text, i)
        if k == "name":
            if end is None or text[i] != '"':
                break
            call.name = json.loads(text[i:end])
        elif k in arg_keys and args_span is None:
            if end is None:
                if text[i] != '"':              # an unfinished object: all of the rest is it
                    call.arguments = text[i:].rstrip()
                break
            args_span = (i, end)
            value = text[i:end]
            call.arguments = json.loads(value) if value.startswith('"') else value
        elif end is None:
            break
        i = skip_ws(text, end) if end is not None else i
        if i < len(text) and text[i] == ",":
            i += 1
    if call.complete and args_span is None:
        call.complete = False
    return call


def read_call_array(text: str, i: int, arg_keys=("arguments", "parameters")) -> tuple[list[Call], int | None]:
    """Calls written as a JSON array of call objects from text[i] ("[" included), and the end of
    the array (None while unfinished)."""
    calls: list[Call] = []
    i = skip_ws(text, i)
    if i >= len(text) or text[i] != "[":
        return calls, None
    i += 1
    while True:
        i = skip_ws(text, i)
        if i >= len(text):
            return calls, None
        if text[i] == "]":
            return calls, i + 1
        end = json_end(text, i)
        calls.append(read_call_object(text[i:] if end is None else text[i:end], arg_keys))
        if end is None:
            return calls, None
        i = skip_ws(text, end)
        if i < len(text) and text[i] == ",":
            i += 1


def finished(parsed: Parsed) -> Parsed:
    """The non-streamed reading: calls that never completed are content (their raw text)."""
    calls, content = [], parsed.content
    for c in parsed.calls:
        if c.complete and c.name:
            calls.append(c)
        else:
            content += c.raw
    return Parsed(content, calls)


class ToolParser:
    """One model family's tool-call format. Subclasses: `parse(text, final)`; `name` (vLLM's)
    and `markers` (strings that, in a chat template, say the family's format)."""
    name = ""
    markers: tuple[str, ...] = ()

    def parse(self, text: str, final: bool) -> Parsed:
        raise NotImplementedError

    def extract(self, text: str) -> Parsed:
        return finished(self.parse(text, True))
