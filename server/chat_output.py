"""A chat answer's text shaped into OpenAI's message: `reasoning_content` split off by the
reasoning parser, then tool calls read by the request's tool mode (tools.py); whole, or as the
deltas of a stream, whose joined fragments are the whole message. A harmony answer (GPT-OSS:
either of its parsers on the server) is read as messages after the reasoning split: its final
text is the content, and with tool_choice "auto" its calls the calls (tool_parsers/openai.py)."""
from dataclasses import dataclass

from .reasoning import ReasoningParser, ReasoningStream
from .tool_parsers import RequiredCallsParser, ToolParser
from .tool_parsers.openai import OpenAIParser
from .tool_parsers.stream import ToolStream, call_id
from .tools import ToolRequest


@dataclass(frozen=True)
class AnswerPlan:
    tool: ToolRequest | None = None
    parser: ToolParser | None = None          # the server's, for tool_choice "auto"
    reasoning: ReasoningParser | None = None  # None: no parser, or thinking disabled
    inside: bool = False                      # the rendered prompt opened the reasoning section
    harmony: bool = False                     # the answer is harmony messages

    def reader(self) -> ToolParser | None:
        """What reads a harmony answer's messages (its calls only under tool_choice "auto")."""
        if not self.harmony:
            return None
        return OpenAIParser(calls=self.tool is not None and self.tool.mode == "auto")

    def calls_parser(self) -> ToolParser | None:
        if self.tool is None or self.tool.mode == "named":
            return None
        if self.tool.mode == "required":
            return RequiredCallsParser()
        return None if self.harmony else self.parser

    def max_calls(self) -> int | None:
        return None if self.tool is None or self.tool.parallel else 1

    def message(self, text: str) -> tuple[dict, bool]:
        """(message, whether it calls tools)."""
        msg: dict = {"role": "assistant"}
        content = text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.split(text, self.inside)
            msg["reasoning_content"] = reasoning or None
        calls = []
        if self.reader() is not None:
            parsed = self.reader().extract(content)
            content = parsed.content
            calls = [(c.name, c.arguments) for c in parsed.calls][:self.max_calls()]
        if self.tool is not None and self.tool.mode == "named":
            calls, content = [(self.tool.name, content)], ""
        elif self.calls_parser() is not None:
            parsed = self.calls_parser().extract(content)
            content = parsed.content
            calls = [(c.name, c.arguments) for c in parsed.calls][:self.max_calls()]
        msg["content"] = (content or None) if calls else content
        if calls:
            msg["tool_calls"] = [{"id": call_id(), "type": "function",
                                  "function": {"name": name, "arguments": args}} for name, args in calls]
        return msg, bool(calls)

    def stream(self) -> "AnswerStream":
        return AnswerStream(self)


class AnswerStream:
    """One choice's deltas: feed each new piece of text (final: the last one)."""

    def __init__(self, plan: AnswerPlan):
        self.plan = plan
        self.reasoning = ReasoningStream(plan.reasoning, plan.inside) if plan.reasoning else None
        reader = plan.reader()
        self.reader = ToolStream(reader, plan.max_calls()) if reader is not None else None
        parser = plan.calls_parser()
        self.tools = ToolStream(parser, plan.max_calls()) if parser is not None else None
        self.named_id = call_id() if plan.tool is not None and plan.tool.mode == "named" else None
        self.named_sent = False

    @property
    def called(self) -> bool:
        return self.named_id is not None or (self.tools is not None and self.tools.called) or \
            (self.reader is not None and self.reader.called)

    def feed(self, text: str, final: bool = False) -> list[dict]:
        out = []
        content = text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.feed(text, final)
            if reasoning:
                out.append({"reasoning_content": reasoning})
        if self.reader is not None:       # harmony: its final text goes on as the content
            deltas = self.reader.feed(content, final)
            content = "".join(d["content"] for d in deltas if "content" in d)
            out += [d for d in deltas if "tool_calls" in d]
        if self.named_id is not None:
            if not self.named_sent:
                self.named_sent = True
                out.append({"tool_calls": [{"index": 0, "id": self.named_id, "type": "function",
                                            "function": {"name": self.plan.tool.name, "arguments": ""}}]})
            if content:
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": content}}]})
        elif self.tools is not None:
            out += self.tools.feed(content, final)
        elif content:
            out.append({"content": content})
        return out
