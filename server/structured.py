"""Structured outputs from the request's fields: OpenAI's `response_format` (json_schema,
json_object, text), vLLM's `structured_outputs` {json, regex, choice, grammar, json_object} and its
older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`, and the grammar that
tool_choice "required" or a named function implies (tools.py). At most one per request: two are
a 400 naming both fields. The engine compiles it before the request is queued
(AsyncEngine.check_structured): a schema, regex or grammar it cannot compile is a 400 naming its
field. With a reasoning parser and thinking on, the constraint starts after the section's end
(StructuredOutputs.start_after)."""
import dataclasses
import json

from infc.runtime.engine.structured.request import StructuredOutputError, StructuredOutputs

from .protocol import _show, bad

KINDS = ("json", "regex", "choice", "grammar", "json_object")     # structured_outputs' keys
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}
# structured_outputs' options this server does not implement: refused unless neutral
_SO_OPTIONS = {"disable_fallback": False, "disable_any_whitespace": False,
               "disable_additional_properties": False, "whitespace_pattern": None, "structural_tag": None}


def _schema(v, where: str, field: str) -> str:
    """A JSON schema (an object, or its JSON text), serialized."""
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except ValueError as e:
            raise bad(f"'{where}' is not valid JSON: {e}", field) from None
    if not isinstance(v, dict):
        raise bad(f"'{where}' must be a JSON schema (an object), got {_show(v)}", field)
    return json.dumps(v, ensure_ascii=False)


def _one(kind: str, v, where: str, field: str) -> StructuredOutputs:
    """One constraint of this kind (json, regex, choice, grammar, json_object) from its value."""
    if kind == "json":
        return StructuredOutputs(json=_schema(v, where, field), field=field)
    if kind == "json_object":
        if v is not True:
            raise bad(f"'{where}' must be true, got {_show(v)}", field)
        return StructuredOutputs(json_object=True, field=field)
    if kind == "choice":
        if not (isinstance(v, list) and v and all(isinstance(c, str) for c in v)):
            raise bad(f"'{where}' must be a non-empty list of strings, got {_show(v)}", field)
        return StructuredOutputs(choice=tuple(v), field=field)
    if not isinstance(v, str) or not v:
        raise bad(f"'{where}' must be a non-empty string, got {_show(v)}", field)
    return StructuredOutputs(**{kind: v}, field=field)


def _format(rf, where: str, field: str, flat: bool) -> StructuredOutputs | None:
    """A response format: chat's response_format, or the Responses API's text.format, whose
    json_schema's name, schema and strict sit in the format itself (flat; vLLM reads it so)."""
    if not isinstance(rf, dict):
        raise bad(f"'{where}' must be an object, got {_show(rf)}", field)
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs(json_object=True, field=field)
    if kind == "json_schema":
        js, at = (rf, where) if flat else (rf.get("json_schema"), f"{where}.json_schema")
        if not isinstance(js, dict):
            raise bad(f"'{at}' must be an object", field)
        if "schema" not in js:
            raise bad(f"'{at}.schema' is required", field)
        strict = js.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise bad(f"'{at}.strict' must be a boolean, got {_show(strict)}", field)
        so = _one("json", js["schema"], f"{at}.schema", field)
        # strict false (OpenAI's): keywords the grammar library lacks are ignored, not refused
        return dataclasses.replace(so, strict=strict is not False)
    raise bad(f"'{where}.type' must be \"text\", \"json_object\" or \"json_schema\", got " + _show(kind), field)


def _response_format(rf) -> StructuredOutputs | None:
    return _format(rf, "response_format", "response_format", flat=False)


def text_format(fmt) -> StructuredOutputs | None:
    """The constraint of a Responses request's text.format (None: free text); a 400 names 'text'."""
    return None if fmt is None else _format(fmt, "text.format", "text", flat=True)


def _structured_outputs(so) -> StructuredOutputs | None:
    if not isinstance(so, dict):
        raise bad(f"'structured_outputs' must be an object, got {_show(so)}", "structured_outputs")
    for k, v in so.items():
        if k in _SO_OPTIONS:
            if v not in (None, _SO_OPTIONS[k]):
                raise bad(f"'structured_outputs.{k}' is not supported by this server", "structured_outputs")
        elif k not in KINDS:
            raise bad(f"'structured_outputs.{k}' is not a structured output this server knows "
                      "(json, regex, choice, grammar, json_object)", "structured_outputs")
    kinds = [k for k in KINDS if so.get(k) is not None and not (k == "json_object" and so[k] is False)]
    if len(kinds) > 1:
        raise bad(f"'structured_outputs' holds {', '.join(kinds)}: give exactly one", "structured_outputs")
    if not kinds:
        return None
    return _one(kinds[0], so[kinds[0]], f"structured_outputs.{kinds[0]}", "structured_outputs")


def constraint(body: dict, tool_schema: dict | None = None) -> StructuredOutputs | None:
    """The request's one structured output (None: free text)."""
    found = []
    if body.get("response_format") is not None:
        found.append(_response_format(body["response_format"]))
    if body.get("structured_outputs") is not None:
        found.append(_structured_outputs(body["structured_outputs"]))
    for name, kind in GUIDED.items():
        if body.get(name) is not None:
            found.append(_one(kind, body[name], name, name))
    if tool_schema is not None:
        found.append(StructuredOutputs(json=json.dumps(tool_schema, ensure_ascii=False), field="tool_choice"))
    found = [so for so in found if so is not None]
    if len(found) > 1:
        raise bad(f"a request takes one structured output, got {len(found)}: "
                  f"{', '.join(so.field for so in found)}", found[1].field)
    return found[0] if found else None


def starting_after(so: StructuredOutputs, ids: list[int]) -> StructuredOutputs:
    return dataclasses.replace(so, start_after=tuple(ids))


async def check(engine, so: StructuredOutputs):
    """The engine compiles it (in a worker thread, within its time limit, or finds it compiled):
    a 400 naming the field if it cannot."""
    try:
        await engine.check_structured(so)
    except StructuredOutputError as e:
        raise refusal(e, so) from None


def refusal(e: StructuredOutputError, so: StructuredOutputs):
    field = e.field or so.field
    return bad(f"'{field}': {e}", field)
