"""What a spec's config symbols may hold, checked as Spec.bind binds them.

A spec does not declare types; what each symbol needs is read from the spec itself:

  1. Every value taken from config.json (or a variant) is JSON data whose numbers are finite:
     NaN, Infinity and overflowing literals (1e400 parses as inf) are refused wherever they sit,
     nested values (rope_scaling) included.
  2. A size is a symbol the spec uses as a dimension: a name in a weight's shape (in arithmetic
     or as the dimension itself, not inside a condition), a weight's `experts` count, or L, the
     layer count. It must be a positive integer below 2**31 (kernels index with int32): not a
     bool, not a float (2.5 or 30.0 layers), not a string. Derived sizes (D = H // Hq) too. L is
     at most MAX_LAYERS (the build is linear in it).
     Null stays allowed except for L: it sizes only weights a `when:` leaves out (DeepSeek's
     q_lora_rank), and a weight it would size is refused by lowering, naming the spec's line.
  3. A symbol takes a value of the kind (number, boolean, string, list, object) of its literal
     default or of what the spec's own variants (the published checkpoints' configs) hold for
     its key; null is always accepted (the spec's defaults and `when:` handle absent values).

Errors name config.json and the key's line there (or the spec's line of a derived symbol).
"""
import ast
import math

MAX_SIZE = 2**31 - 1
LAYERS = "L"                 # the layer-count symbol (compiler/lower.py)
# The most layers a model may have. Lowering, the checkpoint check and the plan are linear in L
# (about 0.2 ms and 2 KB of memory a layer): num_hidden_layers 10**6 took 30 s to fail and 2**31
# would run for days. No published model has more than a few hundred (Llama-3.1-405B: 126).
MAX_LAYERS = 4096

_SIZE_FUNCS = ("max", "min")


def size_names(node) -> set:
    """The names an expression uses as quantities (not as conditions or function arguments)."""
    if isinstance(node, ast.Name):
        return {node.id}
    if isinstance(node, ast.BinOp):
        return size_names(node.left) | size_names(node.right)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        return size_names(node.operand)
    if isinstance(node, ast.IfExp):
        return size_names(node.body) | size_names(node.orelse)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _SIZE_FUNCS:
        return set().union(*(size_names(a) for a in node.args))
    return set()


def size_symbols(spec) -> set:
    """The spec's symbols that are sizes (rule 2)."""
    out = {LAYERS} if LAYERS in spec.bindings else set()
    decls = [(d, set()) for d in (*spec.weights.values(), *spec.layer_weights.values())]
    for kind in (spec.layer_kinds or {}).values():      # a kind's own symbols shadow the config's
        decls += [(d, set(kind.symbols)) for d in kind.weights.values()]
    for d, shadowed in decls:
        names = set().union(*(size_names(e) for e in d.shape))
        if d.experts:
            names.add(d.experts)
        out |= names - shadowed
    return out & set(spec.bindings)


def kind_of(value) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


_LITERALS = {"true": True, "false": False, "True": True, "False": False}


def lookup_keys(keys: list[str], nested: list[str]) -> list[str]:
    """The dotted keys a binding tries, in order: each of its alternatives at the top of
    config.json, then under each nested object (`nested_config`), unless it names one already."""
    out = []
    for key in keys:
        out.append(key)
        if key.split(".")[0] not in nested:
            out += [f"{n}.{key}" for n in nested]
    return out


def expected_kinds(spec, binding) -> set:
    """The kinds a symbol's config value may have (rule 3); empty: any."""
    kinds = set()
    d = binding.default
    if isinstance(d, ast.Constant):
        kinds.add(kind_of(d.value))
    elif isinstance(d, ast.UnaryOp) and isinstance(d.operand, ast.Constant):   # -1, -1.0
        kinds.add(kind_of(d.operand.value))
    elif isinstance(d, ast.Name) and d.id in _LITERALS:
        kinds.add("a boolean")
    for values in (spec.variants or {}).values():
        for key in lookup_keys(binding.keys, spec.nested):
            if isinstance(values, dict) and key.split(".")[0] in values:
                v = values
                for part in key.split("."):
                    v = v.get(part) if isinstance(v, dict) else None
                kinds.add(kind_of(v))
                break
    kinds.discard(None)
    return kinds


def non_finite(value, path: str = "") -> tuple[str, float] | None:
    """(where in value, e.g. "['factor']" or "" for the value itself, the number) of the first
    NaN or infinity in it, or None."""
    if isinstance(value, float) and not math.isfinite(value):
        return path, value
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return None
    for k, v in items:
        found = non_finite(v, f"{path}[{k!r}]" if isinstance(k, str) else f"{path}[{k}]")
        if found is not None:
            return found
    return None


def shown(value) -> str:
    """value's repr, cut short: a config value may be megabytes."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


MAX_LEN = "max_len"          # the context-length symbol (compiler/contract/schema.py plan_max_len)


def max_len_problem(value) -> str | None:
    """Why value cannot be the model's context length (max_len), or None: a negative length
    would refuse every prompt at serve time without saying where it came from. Null and 0 keep
    meaning "not set" (plan_max_len)."""
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return None                         # the kind check (rule 3) speaks for other kinds
    return f"{value} is negative: a context length is a number of tokens" if value < 0 else None


def size_problem(value, symbol: str) -> str | None:
    """Why value cannot be size `symbol`, or None."""
    if value is None and symbol != LAYERS:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        return f"{shown(value)} is {kind_of(value) or 'null'}, not an integer"
    if not 1 <= value <= MAX_SIZE:
        return f"{value} is not in 1..{MAX_SIZE}"
    if symbol == LAYERS and value > MAX_LAYERS:
        return f"{value} layers is more than infc builds ({MAX_LAYERS}; the largest models have a few hundred)"
    return None
