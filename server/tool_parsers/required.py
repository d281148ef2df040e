"""The calls of tool_choice "required": the grammar made the answer a JSON array of
{"name": ..., "parameters": {...}} (server/tools.py writes its schema)."""
from .base import Call, Parsed, ToolParser, read_call_array, skip_ws


class RequiredCallsParser(ToolParser):
    name = "required"

    def parse(self, text: str, final: bool) -> Parsed:
        calls, end = read_call_array(text, skip_ws(text, 0))
        if end is None:
            for k, c in enumerate(calls):
                c.complete, c.raw = False, text if k == 0 else ""
            return Parsed(calls=calls or ([Call(raw=text)] if text else []))
        return Parsed(content=text[end:].strip(), calls=calls)
