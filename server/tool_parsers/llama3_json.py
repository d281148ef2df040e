"""Llama 3.x JSON calls (vLLM: `llama3_json`): the whole answer is one call object, or several
separated by ";", optionally after <|python_tag|>:
    {"name": "get_weather", "parameters": {"city": "Paris"}}
An answer that does not start with "{" is content."""
from .base import Parsed, ToolParser, json_end, read_call_object, skip_ws

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    markers = ("<|python_tag|>", '"parameters": ')

    def parse(self, text: str, final: bool) -> Parsed:
        i = skip_ws(text, 0)
        rest = text[i:]
        if not final and (not rest or PYTHON_TAG.startswith(rest)):
            return Parsed()                   # nothing yet says call or content
        if rest.startswith(PYTHON_TAG):
            i = skip_ws(text, i + len(PYTHON_TAG))
        if i >= len(text) or text[i] != "{":
            return Parsed(content=text) if (final or i < len(text)) else Parsed()
        out = Parsed()
        while i < len(text):
            end = json_end(text, i)
            call = read_call_object(text[i:] if end is None else text[i:end])
            out.calls.append(call)
            if end is None:
                return out
            i = skip_ws(text, end)
            if i < len(text) and text[i] == ";":
                i = skip_ws(text, i + 1)
            elif i < len(text):               # text after the calls: content
                out.content += text[i:]
                return out
        return out
