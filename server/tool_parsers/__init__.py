"""Tool-call parsers, by vLLM's names (--tool-call-parser NAME), and the one a chat template
implies (a template that writes one family's markers, and no other's)."""
from .base import Call, Parsed, ToolParser
from .deepseek_v3 import DeepSeekV3Parser
from .hermes import HermesParser
from .llama3_json import Llama3JsonParser
from .mistral import MistralParser
from .openai import OpenAIParser
from .required import RequiredCallsParser

PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (
    HermesParser, Llama3JsonParser, MistralParser, DeepSeekV3Parser, OpenAIParser)}

__all__ = ["Call", "PARSERS", "Parsed", "RequiredCallsParser", "ToolParser", "from_template", "get"]


def get(name: str) -> ToolParser:
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; choose one of {', '.join(PARSERS)}") from None


def from_template(template: str | None) -> str | None:
    """The parser whose markers the template writes, when exactly one family's are there."""
    if not template:
        return None
    found = [name for name, p in PARSERS.items() if any(m in template for m in p.markers)]
    return found[0] if len(found) == 1 else None
