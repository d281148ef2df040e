"""A YAML loader that remembers the line of every mapping, list and string.

Spec errors must point at a line, so scalars come back as `LStr` and containers as `LDict` /
`LList`, each with a 1-based `.line`. They behave exactly like str / dict / list otherwise.
"""
import yaml

from .contract.errors import SpecError


class LStr(str):
    line: int = 0


class LDict(dict):
    line: int = 0
    key_lines: dict


class LList(list):
    line: int = 0


class _Loader(yaml.SafeLoader):
    pass


def _construct_mapping(loader, node):
    loader.flatten_mapping(node)
    out = LDict()
    out.line = node.start_mark.line + 1
    out.key_lines = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in out:
            raise SpecError(f"duplicate key '{key}'", line=key_node.start_mark.line + 1)
        out[key] = loader.construct_object(value_node, deep=True)
        out.key_lines[key] = key_node.start_mark.line + 1
    return out


def _construct_sequence(loader, node):
    out = LList(loader.construct_object(child, deep=True) for child in node.value)
    out.line = node.start_mark.line + 1
    return out


def _construct_str(loader, node):
    s = LStr(loader.construct_scalar(node))
    s.line = node.start_mark.line + 1
    return s


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_SEQUENCE_TAG, _construct_sequence)
_Loader.add_constructor("tag:yaml.org,2002:str", _construct_str)


def load_yaml(text: str, file: str):
    try:
        return yaml.load(text, Loader=_Loader)
    except SpecError as e:
        e.file = file
        raise
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line = mark.line + 1 if mark else None
        problem = e.problem or e.context
        if "tag:yaml.org,2002:value" in str(problem):   # a bare `=`: YAML's "value" key
            problem = "a lone '=' is YAML syntax: write the expression after it ('D: = H // Hq')"
        raise SpecError(f"YAML syntax error: {problem}", file, line) from None
    except yaml.YAMLError as e:
        raise SpecError(f"YAML error: {e}", file) from None


def line_of(obj, default: int | None = None) -> int | None:
    return getattr(obj, "line", default)
