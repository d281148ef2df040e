"""Hermes-style calls, as Qwen2.5 / Qwen3 (and NousResearch Hermes) write them (vLLM: `hermes`):
    text <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
Text outside the tags is content."""
from .base import Call, Parsed, ToolParser, held_marker, read_call_object

START, END = "<tool_call>", "</tool_call>"


class HermesParser(ToolParser):
    name = "hermes"
    markers = (START,)

    def parse(self, text: str, final: bool) -> Parsed:
        out, i = Parsed(), 0
        while True:
            at = text.find(START, i)
            gap = text[i:] if at < 0 else text[i:at]
            if at < 0 and not final:
                gap = gap[:len(gap) - held_marker(gap, START)]
            if not (out.calls and not gap.strip()):   # blank lines between and after calls are no content
                out.content += gap
            if at < 0:
                return out
            body_at = at + len(START)
            end = text.find(END, body_at)
            body = text[body_at:] if end < 0 else text[body_at:end]
            call = read_call_object(body)
            call.complete = call.complete and end >= 0
            call.raw = text[at:] if end < 0 else text[at:end + len(END)]
            out.calls.append(call)
            if end < 0:
                return out
            i = end + len(END)
