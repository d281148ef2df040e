"""The spec's expression language: Python expression syntax, evaluated without `eval`.

Graph statements (`q, k = f(x, w, eps=eps)`), config defaults (`H // Hq`), shapes
(`[T, Hq*D]`) and `requires` constraints all go through `ast`, so syntax errors come with a
column and nothing in a spec can run code.
"""
import ast
import math
import operator

from .contract.errors import SpecError

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_CMPOPS = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
           ast.Gt: operator.gt, ast.GtE: operator.ge, ast.In: lambda a, b: a in b,
           ast.NotIn: lambda a, b: a not in b, ast.Is: operator.is_, ast.IsNot: operator.is_not}
def _bf16(x) -> float:
    """x rounded to bfloat16 (nearest even): HF scales some activations by a bf16 constant
    (Gemma's embedding normalizer sqrt(H))."""
    import struct
    bits = struct.unpack("<I", struct.pack("<f", float(x)))[0]
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return struct.unpack("<f", struct.pack("<I", bits))[0]


_FUNCS = {"len": len, "min": min, "max": max, "int": int, "float": float, "bf16": _bf16,
          "log": math.log}   # log: natural log (DeepSeek's YaRN mscale, 0.1 m ln(s) + 1)
_CONSTS = {"true": True, "false": False, "none": None, "True": True, "False": False, "None": None}


def parse_expr(text: str, file: str | None, line: int | None) -> ast.expr:
    try:
        return ast.parse(str(text).strip(), mode="eval").body
    except SyntaxError as e:
        raise SpecError(f"cannot parse expression '{text}': {e.msg}", file, line) from None


def parse_statement(text: str, file: str | None, line: int | None) -> tuple[list[str], ast.expr]:
    """`a, b = expr` -> (['a', 'b'], expr)."""
    try:
        tree = ast.parse(str(text).strip(), mode="exec")
    except SyntaxError as e:
        raise SpecError(f"cannot parse statement '{text}': {e.msg}", file, line) from None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assign) or len(tree.body[0].targets) != 1:
        raise SpecError(f"a graph statement is 'name = op(...)' or 'a, b = op(...)', got '{text}'",
                        file, line)
    target = tree.body[0].targets[0]
    elts = target.elts if isinstance(target, ast.Tuple) else [target]
    names = []
    for e in elts:
        if not isinstance(e, ast.Name):
            raise SpecError(f"assignment target must be a name in '{text}'", file, line)
        names.append(e.id)
    return names, tree.body[0].value


class Unknown(Exception):
    def __init__(self, name):
        super().__init__(name)
        self.name = name


class EvalError(ValueError):
    """An expression that cannot be evaluated: unsupported syntax, mismatched types, x // 0..."""

    def __init__(self, message: str, reason: str | None = None):
        super().__init__(message)
        self.reason = reason or message


def evaluate(node: ast.expr, env: dict):
    """Evaluate a restricted expression. Raises Unknown(name) for unbound names and EvalError
    for anything else that goes wrong (the caller adds file and line)."""
    try:
        return _evaluate(node, env)
    except (Unknown, EvalError):
        raise
    except (ArithmeticError, TypeError, ValueError, LookupError) as e:
        raise EvalError(f"cannot evaluate '{ast.unparse(node)}': {e}", str(e)) from None


def _evaluate(node: ast.expr, env: dict):
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        if node.id in env:
            return env[node.id]
        if node.id in _CONSTS:
            return _CONSTS[node.id]
        raise Unknown(node.id)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        return _BINOPS[type(node.op)](_evaluate(node.left, env), _evaluate(node.right, env))
    if isinstance(node, ast.UnaryOp):
        v = _evaluate(node.operand, env)
        if isinstance(node.op, ast.USub):
            return -v
        if isinstance(node.op, ast.Not):
            return not v
        if isinstance(node.op, ast.UAdd):
            return v
    if isinstance(node, ast.BoolOp):
        vals = [_evaluate(v, env) for v in node.values]
        return all(vals) if isinstance(node.op, ast.And) else any(vals)
    if isinstance(node, ast.Compare):
        left = _evaluate(node.left, env)
        for op, comp in zip(node.ops, node.comparators):
            right = _evaluate(comp, env)
            if type(op) not in _CMPOPS:
                raise EvalError(f"unsupported comparison in '{ast.unparse(node)}'")
            if not _CMPOPS[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_evaluate(e, env) for e in node.elts]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCS:
        return _FUNCS[node.func.id](*[_evaluate(a, env) for a in node.args])
    if isinstance(node, ast.Subscript):
        return _evaluate(node.value, env)[_evaluate(node.slice, env)]
    if isinstance(node, ast.IfExp):         # `a if cond else b`: per-layer kinds, derived symbols
        return _evaluate(node.body, env) if _evaluate(node.test, env) else _evaluate(node.orelse, env)
    raise EvalError(f"unsupported expression '{ast.unparse(node)}'")


def free_names(node: ast.expr) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and n.id not in _CONSTS}
