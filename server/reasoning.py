"""Reasoning parsers (--reasoning-parser, vLLM's names): the model's <think>...</think> section
is `reasoning_content`, the rest `content` (in the message, and in each stream delta).

qwen3: the answer reasons when it opens with <think> (or the rendered prompt ends with it, as
newer Qwen3 templates do); chat_template_kwargs {"enable_thinking": false} makes the template
close the section in the prompt, and the answer is content. deepseek_r1: the answer reasons from
its first token (R1's template opens the section in the prompt; a leading <think> is dropped).
Either way an answer cut off before </think> is all reasoning.
openai_gptoss: GPT-OSS's harmony messages (server/tool_parsers/harmony.py): the analysis channel's bodies are
the reasoning, the other messages stay harmony text for the harmony reader (AnswerPlan.reader).
"""
from .tool_parsers import harmony
from .tool_parsers.base import held_marker

START, END = "<think>", "</think>"


class ReasoningParser:
    name = ""
    always_inside = False            # the answer starts inside the section
    end = END                        # what a structured answer's grammar starts after
    harmony = False                  # the answer is harmony (special tokens kept, read as messages)

    def inside_from(self, prompt_text: str) -> bool:
        return self.always_inside or prompt_text.rstrip().endswith(START)

    def split(self, text: str, inside: bool, final: bool = True) -> tuple[str, str] | None:
        """(reasoning, content) of the text so far (partial markers held back unless final);
        None: nothing yet tells whether it reasons."""
        head = text.lstrip()
        if head.startswith(START):
            inside, text = True, head[len(START):]
        elif not final and START.startswith(head):
            return None
        if not inside:
            return "", text
        reasoning, sep, content = text.partition(END)
        if not sep and not final:
            reasoning = reasoning[:len(reasoning) - held_marker(reasoning, END)]
        return reasoning, content


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    always_inside = True


class GptOssReasoningParser(ReasoningParser):
    name = "openai_gptoss"
    end = harmony.FINAL_MARKER
    harmony = True

    def inside_from(self, prompt_text: str) -> bool:
        return False

    def split(self, text: str, inside: bool, final: bool = True) -> tuple[str, str]:
        """(the analysis bodies, the other messages' text): what is not read yet (a header still
        arriving) is in neither, so both only grow as the text does."""
        r = harmony.read(text, final)
        reasoning, rest = [], []
        for m in r.messages:
            if m.channel == "analysis" and m.recipient is None:
                reasoning.append(m.body)
            else:
                rest.append(text[m.start:m.end])
        return "\n".join(reasoning), "".join(rest) + r.tail


REASONING_PARSERS = {p.name: p for p in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser, GptOssReasoningParser)}


def get(name: str) -> ReasoningParser:
    try:
        return REASONING_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {', '.join(REASONING_PARSERS)}") from None


def thinking_enabled(chat_template_kwargs: dict) -> bool:
    """Qwen3's enable_thinking / DeepSeek-V3.1's thinking, false: the template closes the section."""
    return chat_template_kwargs.get("enable_thinking", True) is not False and \
        chat_template_kwargs.get("thinking", True) is not False


class ReasoningStream:
    """The reasoning and content deltas of a growing text."""

    def __init__(self, parser: ReasoningParser, inside: bool):
        self.parser, self.inside = parser, inside
        self.text, self.sent = "", ("", "")

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        self.text += delta
        now = self.parser.split(self.text, self.inside, final)
        if now is None:
            return "", ""
        r0, c0 = self.sent
        r = now[0][len(r0):] if now[0].startswith(r0) else ""
        c = now[1][len(c0):] if now[1].startswith(c0) else ""
        self.sent = (r0 + r, c0 + c)
        return r, c
