"""Mistral calls (vLLM: `mistral`): text, then [TOOL_CALLS] and a JSON array of call objects
    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]
or, with the newer tokenizers (v11+), each call as NAME[ARGS]{...} after its own [TOOL_CALLS]."""
from .base import Call, Parsed, ToolParser, held_marker, json_end, read_call_array, skip_ws

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"


class MistralParser(ToolParser):
    name = "mistral"
    markers = (TOOL_CALLS,)

    def parse(self, text: str, final: bool) -> Parsed:
        at = text.find(TOOL_CALLS)
        if at < 0:
            keep = 0 if final else held_marker(text, TOOL_CALLS)
            return Parsed(content=text[:len(text) - keep])
        out = Parsed(content=text[:at])
        i = at
        while i < len(text) and text.startswith(TOOL_CALLS, i):
            j = skip_ws(text, i + len(TOOL_CALLS))
            if j >= len(text):
                out.calls.append(Call(raw=text[i:]))
                return out
            if text[j] == "[":                # the JSON array form
                calls, end = read_call_array(text, j)
                if end is None:               # unfinished: all of it is content at the end
                    for k, c in enumerate(calls):
                        c.complete, c.raw = False, text[i:] if k == 0 else ""
                out.calls += calls or [Call(raw=text[i:])]
                if end is None:
                    return out
                i = skip_ws(text, end)
                continue
            call, i = self._name_args(text, i, j)
            out.calls.append(call)
            if not call.complete:
                return out
        tail = text[i:]
        out.content += tail[:len(tail) - (0 if final else held_marker(tail, TOOL_CALLS))]
        return out

    @staticmethod
    def _name_args(text: str, start: int, j: int) -> tuple[Call, int]:
        """NAME[ARGS]{...} from text[j]; the call and where its text ends."""
        sep = text.find(ARGS, j)
        if sep < 0:
            return Call(raw=text[start:]), len(text)
        call = Call(name=text[j:sep].strip(), raw=text[start:])
        k = skip_ws(text, sep + len(ARGS))
        end = json_end(text, k)
        if end is None:
            call.arguments = text[k:].rstrip() if text[k:k + 1] == "{" else ""
            return call, len(text)
        call.arguments, call.complete, call.raw = text[k:end], True, text[start:end]
        return call, skip_ws(text, end)
