"""A StructuredOutputs as an llguidance grammar, compiled against the model's tokenizer.

Whatever the library refuses (JSON that is not a schema, a keyword it does not implement, a bad
regex, a grammar that does not parse) is a StructuredOutputError naming the request's field, with
the library's reason. Parser limits bound the work a grammar may cost at compile time and at
each step (llguidance's LLParserLimits); the wall-clock limit is the cache's (cache.py).
"""
import dataclasses
import json

import llguidance
from llguidance import LLMatcher, LLParserLimits, LLTokenizer

from infc.config import STRUCTURED_JSON_WHITESPACE_FLEXIBLE

from .request import StructuredOutputError, StructuredOutputs

# terse errors: the verbose ones carry the parser's state and the whole grammar
LIMITS = LLParserLimits(verbose_errors=False)
MAX_MESSAGE = 500


def kind_of(so: StructuredOutputs) -> str:
    """What the request constrains to, in words (for messages); exactly one kind is allowed."""
    kinds = [name for name, given in (("JSON schema", so.json is not None), ("JSON object", so.json_object),
                                      ("regex", so.regex is not None), ("choice", so.choice is not None),
                                      ("grammar", so.grammar is not None)) if given]
    if len(kinds) != 1:
        raise StructuredOutputError(
            f"exactly one of json, json_object, regex, choice or grammar must be given, got "
            f"{', '.join(kinds) or 'none'}", so.field)
    return kinds[0]


def cache_key(so: StructuredOutputs) -> StructuredOutputs:
    """The request as its compile's key: hashable (a choice given as a list becomes a tuple), and
    without start_after (where a sequence starts in the grammar is its own)."""
    for name in ("json", "regex", "grammar"):
        value = getattr(so, name)
        if value is not None and not isinstance(value, str):
            raise StructuredOutputError(f"{name} must be a string, got {type(value).__name__}", so.field)
    choice = so.choice
    if choice is not None:
        if isinstance(choice, str) or not all(isinstance(c, str) for c in choice):
            raise StructuredOutputError("choice must be a list of strings", so.field)
        choice = tuple(choice)
    return dataclasses.replace(so, choice=choice, start_after=())


def grammar_text(so: StructuredOutputs) -> str:
    """The request as llguidance's grammar text (not checked yet: compile() checks it)."""
    kind = kind_of(so)
    json_options = {"whitespace_flexible": STRUCTURED_JSON_WHITESPACE_FLEXIBLE, "lenient": not so.strict}
    try:
        if kind == "JSON schema":
            try:
                schema = json.loads(so.json)
            except ValueError as e:
                raise StructuredOutputError(f"the JSON schema is not valid JSON: {e}", so.field) from None
            if not isinstance(schema, (dict, bool)):
                raise StructuredOutputError("the JSON schema must be an object or a boolean, got "
                                            f"{type(schema).__name__}", so.field)
            # defaults: a schema's own "x-guidance" options override these
            return LLMatcher.grammar_from_json_schema(schema, defaults=json_options)
        if kind == "JSON object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=json_options)
        if kind == "regex":
            return LLMatcher.grammar_from_regex(so.regex)
        if kind == "choice":
            if not so.choice:
                raise StructuredOutputError("choice must be a non-empty list of strings", so.field)
            return llguidance.grammar_from("choice", json.dumps(list(so.choice)))
        return llguidance.grammar_from("grammar", so.grammar)     # Lark, or GBNF converted to Lark
    except StructuredOutputError:
        raise
    except (ValueError, TypeError) as e:
        raise StructuredOutputError(f"invalid {kind}: {short(str(e))}", so.field) from None


def compile_grammar(so: StructuredOutputs, tokenizer: LLTokenizer) -> LLMatcher:
    """A fresh matcher at the grammar's start (a template: sequences take deep copies);
    StructuredOutputError if the library refuses it."""
    kind = kind_of(so)
    m = LLMatcher(tokenizer, grammar_text(so), log_level=0, limits=LIMITS)
    if m.is_error():
        raise StructuredOutputError(f"invalid {kind}: {short(m.get_error())}", so.field)
    return m


def short(message: str) -> str:
    message = message.strip()
    return message if len(message) <= MAX_MESSAGE else message[:MAX_MESSAGE] + " ..."
