"""DeepSeek-V3 / R1 calls (vLLM: `deepseek_v3`), in the model's own tool tokens:
    text<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"""
from .base import Call, Parsed, ToolParser, held_marker, json_end, skip_ws

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, SEP, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
FENCE_OPEN, FENCE_CLOSE = "```json", "```"


class DeepSeekV3Parser(ToolParser):
    name = "deepseek_v3"
    markers = (CALLS_BEGIN,)

    def parse(self, text: str, final: bool) -> Parsed:
        at = text.find(CALLS_BEGIN)
        if at < 0:
            keep = 0 if final else held_marker(text, CALLS_BEGIN)
            return Parsed(content=text[:len(text) - keep])
        out, i = Parsed(content=text[:at]), at + len(CALLS_BEGIN)
        while True:
            i = skip_ws(text, i)
            if not text.startswith(CALL_BEGIN, i):
                break
            first = not out.calls
            call, i = self._call(text, i)
            if first:                 # the section's opening marker goes with its first call
                call.raw = text[at:at + len(CALLS_BEGIN)] + call.raw
            out.calls.append(call)
            if not call.complete:
                return out
        if not out.calls:
            if final:
                out.content += text[at:]
        elif text.startswith(CALLS_END, i):
            out.content += text[i + len(CALLS_END):]
        elif final:
            out.content += text[i:]
        return out

    @staticmethod
    def _call(text: str, start: int) -> tuple[Call, int]:
        call = Call(raw=text[start:])
        sep = text.find(SEP, start)
        nl = text.find("\n", sep + 1) if sep >= 0 else -1
        if nl < 0:
            return call, len(text)
        call.name = text[sep + len(SEP):nl].strip()
        k = skip_ws(text, nl)
        if not text.startswith(FENCE_OPEN, k):
            call.name = None if not FENCE_OPEN.startswith(text[k:]) else call.name
            return call, len(text)
        k = skip_ws(text, k + len(FENCE_OPEN))
        end = json_end(text, k)
        if end is None:
            call.arguments = text[k:].rstrip() if text[k:k + 1] == "{" else ""
            return call, len(text)
        call.arguments = text[k:end]
        close = text.find(CALL_END, end)
        if close < 0 or text[end:close].strip() != FENCE_CLOSE:
            return call, len(text)
        call.complete, call.raw = True, text[start:close + len(CALL_END)]
        return call, close + len(CALL_END)
