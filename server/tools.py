"""A chat request's `tools`, `tool_choice` and `parallel_tool_calls`, checked, and how its answer
becomes tool calls.

tool_choice "none": the tools are only shown to the template; "auto" (the default with tools):
the server's tool parser reads calls out of the answer (a server without one answers vLLM's
400); "required" and a named function: a grammar makes the answer the call(s), so the arguments
always match the tool's parameters schema (vLLM's approach; objects closed to properties they
do not name, as vLLM's default backend reads them): a named function's answer is its
arguments object, "required"'s a JSON array of {"name", "parameters"} (one item at most with
parallel_tool_calls false).
"""
import json
from dataclasses import dataclass

from .protocol import _show, bad

NO_PARSER = ('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set')
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolRequest:
    mode: str                        # "auto" | "required" | "named"
    parallel: bool = True
    name: str | None = None          # the named function
    schema: dict | None = None       # the grammar's JSON schema ("required", "named")


def _functions(tools) -> dict[str, dict]:
    """name -> parameters schema, every tool checked."""
    if not isinstance(tools, list):
        raise bad("'tools' must be a list of objects", "tools")
    out = {}
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict):
            raise bad(f"'{where}' must be an object", "tools")
        if t.get("type", "function") != "function":
            raise bad(f"'{where}.type' must be \"function\", got {_show(t.get('type'))}", "tools")
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise bad(f"'{where}.function' must be an object", "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise bad(f"'{where}.function.name' must be a non-empty string", "tools")
        params = fn.get("parameters")
        if params is None:
            params = EMPTY_PARAMETERS
        if not isinstance(params, dict):
            raise bad(f"'{where}.function.parameters' must be a JSON schema object", "tools")
        if name in out:
            raise bad(f"'{where}.function.name': two tools are named {name!r}", "tools")
        out[name] = params
    return out


def _choice(v, has_tools: bool) -> tuple[str, str | None]:
    if v is None:
        return ("auto" if has_tools else "none"), None
    if v in ("none", "auto", "required"):
        return v, None
    if isinstance(v, dict) and v.get("type") == "function" and isinstance(v.get("function"), dict):
        name = v["function"].get("name")
        if isinstance(name, str) and name:
            return "named", name
    raise bad("'tool_choice' must be \"none\", \"auto\", \"required\" or "
              "{\"type\": \"function\", \"function\": {\"name\": ...}}, got " + _show(v), "tool_choice")


def closed(schema):
    """The schema with every object that does not say otherwise closed to properties it does not
    name (additionalProperties false, as vLLM's default grammar backend reads a schema): a call's
    arguments then hold what the tool declares, and a small model does not ramble on inside them
    until max_tokens."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) if k in _SUBSCHEMAS else v for k, v in schema.items()}
    for k in ("properties", "$defs", "definitions", "patternProperties"):
        if isinstance(schema.get(k), dict):
            out[k] = {name: closed(v) for name, v in schema[k].items()}
    if (schema.get("type") == "object" or "properties" in schema) and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


_SUBSCHEMAS = ("items", "anyOf", "oneOf", "allOf", "not", "prefixItems")


def required_schema(functions: dict[str, dict], parallel: bool) -> dict:
    item = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
             "required": ["name", "parameters"], "additionalProperties": False}
            for name, params in functions.items()]
    schema = {"type": "array", "minItems": 1, "items": item[0] if len(item) == 1 else {"anyOf": item}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def tool_request(body: dict, has_parser: bool) -> ToolRequest | None:
    """The request's tool calling (None: its answer is text), every field checked."""
    tools = body.get("tools")
    functions = _functions(tools) if tools is not None else {}
    mode, name = _choice(body.get("tool_choice"), bool(functions))
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad(f"'parallel_tool_calls' must be a boolean, got {_show(parallel)}", "parallel_tool_calls")
    parallel = parallel is not False
    if mode == "none":
        return None
    if not functions:
        if mode == "auto":
            return None
        raise bad(f"'tool_choice' {json.dumps(body.get('tool_choice'))} needs 'tools'", "tool_choice")
    if mode == "auto":
        if not has_parser:
            raise bad(NO_PARSER, "tool_choice")
        return ToolRequest("auto", parallel)
    if mode == "named":
        if name not in functions:
            raise bad(f"'tool_choice' names the function {name!r}, which is not in 'tools' "
                      f"({', '.join(functions)})", "tool_choice")
        return ToolRequest("named", parallel, name, closed(functions[name]))
    return ToolRequest("required", parallel, None, required_schema(
        {name: closed(params) for name, params in functions.items()}, parallel))
