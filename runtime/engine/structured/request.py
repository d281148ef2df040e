"""What a request asks its output to match (vLLM's `structured_outputs`): exactly one of a JSON
schema, any JSON object, a regex, a choice of strings or an EBNF/Lark grammar.

The server fills it from the API's spellings (response_format, structured_outputs, guided_*,
tool_choice); the engine compiles it with the grammar library and masks each step's logits.
"""
from dataclasses import dataclass


class StructuredOutputError(ValueError):
    """A schema, regex, choice or grammar that cannot be compiled; `field` names the request
    field it came from (the server's 400 names it)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class StructuredOutputs:
    json: str | None = None            # a JSON schema, serialized (so the request is hashable)
    json_object: bool = False          # any JSON object (response_format json_object)
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None         # EBNF (GBNF) or Lark
    field: str = "structured_outputs"  # the request field it came from, for errors
    # a JSON schema's keywords that the grammar library does not implement: refused (strict, a
    # 400 naming them), or ignored (False: OpenAI's json_schema "strict": false)
    strict: bool = True
    # the token ids that end a reasoning section (e.g. "</think>"): the constraint applies from
    # the token after them; empty: from the first generated token
    start_after: tuple[int, ...] = ()
