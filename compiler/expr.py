"""The spec's expression language: Python expression syntax, evaluated without `eval`.

Graph statements (`q, k = f(x, w, eps=eps)`), config defaults (`H // Hq`), shapes
(`[T, Hq*D]`) and `requires` constraints all go through `ast`, so syntax errors come with a
column and nothing in a spec can run code. Evaluation is bounded (compiler/contract/safe_eval.py's
operators, MAX_STEPS nodes, TIME_BUDGET seconds), so no spec or config can hang or exhaust
the build.
"""
import ast
import math
import operator
import time

from .contract.errors import SpecError
from .contract.safe_eval import ExprLimit, add, check_result, modulo, multiply, power

MAX_STEPS = 100_000          # nodes one evaluation may visit
TIME_BUDGET = 1.0            # seconds one evaluation may take

_BINOPS = {ast.Add: add, ast.Sub: operator.sub, ast.Mult: multiply,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: modulo,
           ast.Pow: power}
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


def _parse(text: str, mode: str, what: str, file, line):
    try:
        return ast.parse(str(text).strip(), mode=mode)
    except SyntaxError as e:
        raise SpecError(f"cannot parse {what} '{text}': {e.msg}", file, line) from None
    except (ValueError, RecursionError, MemoryError) as e:   # a 5000-digit literal, deep nesting
        raise SpecError(f"cannot parse {what} '{str(text)[:80]}': {type(e).__name__}: {e}", file,
                        line) from None


def parse_expr(text: str, file: str | None, line: int | None) -> ast.expr:
    return _parse(text, "eval", "expression", file, line).body


def parse_statement(text: str, file: str | None, line: int | None) -> tuple[list[str], ast.expr]:
    """`a, b = expr` -> (['a', 'b'], expr)."""
    tree = _parse(text, "exec", "statement", file, line)
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
        return _evaluate(node, env, _Budget())
    except (Unknown, EvalError):
        raise
    except RecursionError:
        raise EvalError(f"cannot evaluate '{_shown(node)}': nested too deeply") from None
    except (ArithmeticError, TypeError, ValueError, LookupError) as e:   # ExprLimit included
        raise EvalError(f"cannot evaluate '{_shown(node)}': {e}", str(e)) from None


def _shown(node) -> str:
    try:
        text = ast.unparse(node)
    except RecursionError:
        return "<an expression nested too deeply to show>"
    return text if len(text) <= 200 else text[:200] + "..."


class _Budget:
    """Nodes visited and a deadline: evaluation has no loops, so this only ever trips on input
    built to exhaust it, and then fails in well under a second."""

    def __init__(self):
        self.steps = 0
        self.deadline = time.monotonic() + TIME_BUDGET

    def step(self):
        self.steps += 1
        if self.steps > MAX_STEPS:
            raise ExprLimit(f"more than {MAX_STEPS} steps")
        if self.steps % 256 == 0 and time.monotonic() > self.deadline:
            raise ExprLimit(f"more than {TIME_BUDGET} s")


def _evaluate(node: ast.expr, env: dict, budget: _Budget):
    budget.step()
    if isinstance(node, ast.Constant):
        return check_result(node.value)
    if isinstance(node, ast.Name):
        if node.id in env:
            return env[node.id]
        if node.id in _CONSTS:
            return _CONSTS[node.id]
        raise Unknown(node.id)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        return _BINOPS[type(node.op)](_evaluate(node.left, env, budget), _evaluate(node.right, env, budget))
    if isinstance(node, ast.UnaryOp):
        v = _evaluate(node.operand, env, budget)
        if isinstance(node.op, ast.USub):
            return -v
        if isinstance(node.op, ast.Not):
            return not v
        if isinstance(node.op, ast.UAdd):
            return v
    if isinstance(node, ast.BoolOp):        # short-circuit, as Python: `x is None or len(x) == L`
        stop = not isinstance(node.op, ast.And)
        for v in node.values:
            if bool(_evaluate(v, env, budget)) == stop:
                return stop
        return not stop
    if isinstance(node, ast.Compare):
        left = _evaluate(node.left, env, budget)
        for op, comp in zip(node.ops, node.comparators):
            right = _evaluate(comp, env, budget)
            if type(op) not in _CMPOPS:
                raise EvalError(f"unsupported comparison in '{_shown(node)}'")
            if not _CMPOPS[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_evaluate(e, env, budget) for e in node.elts]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCS:
        if node.keywords:          # int('10', base=16) would silently ignore base: 10
            raise EvalError(f"{node.func.id}() takes no keyword arguments in '{_shown(node)}'")
        return check_result(_FUNCS[node.func.id](*[_evaluate(a, env, budget) for a in node.args]))
    if isinstance(node, ast.Subscript):
        return _evaluate(node.value, env, budget)[_evaluate(node.slice, env, budget)]
    if isinstance(node, ast.IfExp):         # `a if cond else b`: per-layer kinds, derived symbols
        branch = node.body if _evaluate(node.test, env, budget) else node.orelse
        return _evaluate(branch, env, budget)
    raise EvalError(f"unsupported expression '{_shown(node)}'")


def free_names(node: ast.expr) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and n.id not in _CONSTS}
