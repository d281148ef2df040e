"""A YAML loader that remembers the line of every mapping, list and string.

Spec errors must point at a line, so scalars come back as `LStr` and containers as `LDict` /
`LList`, each with a 1-based `.line`. They behave exactly like str / dict / list otherwise.
"""
from collections.abc import Hashable

import yaml

from .contract.errors import SpecError


class LStr(str):
    line: int = 0


class LDict(dict):
    line: int = 0
    key_lines: dict


class LList(list):
    line: int = 0
    item_lines: list          # the 1-based line of each item (a non-string item has no .line)


class _Loader(yaml.SafeLoader):
    pass


def _construct_mapping(loader, node):
    loader.flatten_mapping(node)
    out = LDict()
    out.line = node.start_mark.line + 1
    out.key_lines = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        if not isinstance(key, Hashable):   # `[a, b]: x` / `{a: 1}: x`: a key must be a scalar
            what = "a list" if isinstance(key, list) else "a mapping"
            raise SpecError(f"a mapping key must be a name or number, got {what} {key!r}",
                            line=key_node.start_mark.line + 1)
        if key in out:
            raise SpecError(f"duplicate key '{key}'", line=key_node.start_mark.line + 1)
        out[key] = loader.construct_object(value_node, deep=True)
        out.key_lines[key] = key_node.start_mark.line + 1
    return out


def _construct_sequence(loader, node):
    out = LList(loader.construct_object(child, deep=True) for child in node.value)
    out.line = node.start_mark.line + 1
    out.item_lines = [child.start_mark.line + 1 for child in node.value]
    return out


def _construct_str(loader, node):
    s = LStr(loader.construct_scalar(node))
    s.line = node.start_mark.line + 1
    return s


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_SEQUENCE_TAG, _construct_sequence)
_Loader.add_constructor("tag:yaml.org,2002:str", _construct_str)


# The most nodes a spec may hold with its aliases expanded. A real spec has a few thousand; an
# alias repeats its anchor's node without copying it, so nine levels of ten aliases each (the
# "billion laughs") load as a few dozen objects that any walk over the data (a config value's
# checks, its repr) visits 10**9 times: refused before it is built.
MAX_NODES = 1_000_000


def _expanded_size(node, sizes: dict) -> int:
    """Nodes in `node` with every alias expanded (memoized per node: linear in the document)."""
    key = id(node)
    if key in sizes:
        if sizes[key] is None:              # an anchor inside itself: yaml refuses it next
            return 1
        return sizes[key]
    sizes[key] = None
    n = 1
    if isinstance(node, yaml.SequenceNode):
        n += sum(_expanded_size(c, sizes) for c in node.value)
    elif isinstance(node, yaml.MappingNode):
        n += sum(_expanded_size(k, sizes) + _expanded_size(v, sizes) for k, v in node.value)
    sizes[key] = min(n, MAX_NODES + 1)     # capped: the sum stays small however deep it goes
    return sizes[key]


def _load(text: str):
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is not None and _expanded_size(node, {}) > MAX_NODES:
            raise SpecError(f"the YAML expands to more than {MAX_NODES:,} nodes (aliases of aliases "
                            f"of an anchor?)", line=node.start_mark.line + 1)
        return loader.construct_document(node) if node is not None else None
    finally:
        loader.dispose()


def load_yaml(text: str, file: str):
    try:
        return _load(text)
    except SpecError as e:
        e.file = file
        raise
    except RecursionError:       # `[[[[...` thousands deep: the composer and constructor recurse
        raise SpecError("YAML nested too deeply", file) from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line = mark.line + 1 if mark else None
        problem = e.problem or e.context
        if "tag:yaml.org,2002:value" in str(problem):   # a bare `=`: YAML's "value" key
            problem = "a lone '=' is YAML syntax: write the expression after it ('D: = H // Hq')"
        raise SpecError(f"YAML syntax error: {problem}", file, line) from None
    except yaml.YAMLError as e:
        raise SpecError(f"YAML error: {e}", file) from None
    except ValueError as e:      # a constructor's own: an integer of more than 4300 digits
        raise SpecError(f"YAML error: {e}", file) from None


def line_of(obj, default: int | None = None) -> int | None:
    return getattr(obj, "line", default)


def item_line(items, k: int, default: int | None = None) -> int | None:
    """The line of items[k] (a list's entry): its own, else the loader's record of where it sat."""
    own = line_of(items[k])
    if own is not None:
        return own
    lines = getattr(items, "item_lines", None)
    return lines[k] if lines and k < len(lines) else default
