"""A parser's readings of a growing text turned into OpenAI's streamed deltas: content as it
comes, and per call its index, id, type and function name first, then its arguments in fragments
(the openai SDK's accumulator joins them into the non-streamed call)."""
import uuid

from .base import Parsed, ToolParser


def call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class ToolStream:
    """Feed it the whole text so far; it answers what is new since the last feed."""

    def __init__(self, parser: ToolParser, max_calls: int | None = None):
        self.parser, self.max_calls = parser, max_calls
        self.text, self.content = "", ""
        self.ids: list[str] = []               # per call announced (its name sent)
        self.sent_args: list[str] = []

    @property
    def called(self) -> bool:
        return bool(self.ids)

    def feed(self, delta: str, final: bool = False) -> list[dict]:
        self.text += delta
        return self._diff(self.parser.parse(self.text, final))

    def _diff(self, parsed: Parsed) -> list[dict]:
        out = []
        if parsed.content.startswith(self.content) and len(parsed.content) > len(self.content):
            out.append({"content": parsed.content[len(self.content):]})
            self.content = parsed.content
        calls = parsed.calls if self.max_calls is None else parsed.calls[:self.max_calls]
        for k, c in enumerate(calls):
            if k > len(self.ids) or c.name is None:
                break                           # calls are announced in order, each once named
            if k == len(self.ids):
                self.ids.append(call_id())
                self.sent_args.append("")
                out.append({"tool_calls": [{"index": k, "id": self.ids[k], "type": "function",
                                            "function": {"name": c.name, "arguments": ""}}]})
            sent = self.sent_args[k]
            if c.arguments.startswith(sent) and len(c.arguments) > len(sent):
                out.append({"tool_calls": [{"index": k, "function": {"arguments": c.arguments[len(sent):]}}]})
                self.sent_args[k] = c.arguments
        return out
