"""GPT-OSS's calls (vLLM: `openai`), in its harmony messages (server/tool_parsers/harmony.py): a commentary
message to `functions.NAME` is a call, its body the JSON arguments; the final channel and
commentary preambles (no recipient) are content; analysis messages are the reasoning parser's
(openai_gptoss) and no content. What is not harmony, a call whose arguments are no JSON, and a
message to a built-in tool (browser.*, python) are content as written."""
from . import harmony
from .base import Call, Parsed, ToolParser, json_end, skip_ws

FUNCTIONS = "functions."


class OpenAIParser(ToolParser):
    name = "openai"
    markers = ("<|channel|>", "to=functions.")   # any harmony template writes the first
    harmony = True                # the answer is harmony: the server keeps special tokens

    def __init__(self, calls: bool = True):
        """calls False: a request without tools, where a call's text is content."""
        self.calls = calls

    def parse(self, text: str, final: bool) -> Parsed:
        r = harmony.read(text, final)
        out = Parsed()
        for m in r.messages:
            raw = text[m.start:m.end]
            if m.recipient is None:
                if m.channel != "analysis":
                    out.content += m.body
            elif m.recipient.startswith(FUNCTIONS) and self.calls:
                out.calls.append(_call(m, raw))
            else:
                out.content += raw
        out.content += r.tail
        return out


def _call(m: harmony.Message, raw: str) -> Call:
    call = Call(name=m.recipient[len(FUNCTIONS):] or None, raw=raw)
    start = skip_ws(m.body, 0)
    call.arguments = m.body[start:]
    if m.complete:
        end = json_end(m.body, start) if start < len(m.body) else None
        call.complete = end is not None and not m.body[end:].strip() and call.name is not None
    return call
