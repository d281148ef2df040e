"""Arithmetic on expressions that come from files, bounded and unable to run code.

Specs (compiler/expr.py) and plans (launch grids, scratch and metadata sizes: compiler/contract/bind.py,
runtime/cuda/runner.py) both hold formulas as text. This module is their shared, stdlib-only
core, so the runtime can use it without importing the compiler's internals:

  - bounded operators: `**`, `*` and `+` refuse a result too large to be any size (an integer
    over MAX_INT_BITS bits, a list or string over MAX_LEN items) before computing it, so
    `10 ** 10 ** 10` or `[1] * 10**10` fails at once rather than hanging or exhausting memory;
  - `compile_int`: an integer formula over named dims (`cdiv(T * 2560, 1024)`) checked against
    a whitelist (integer constants, names, + - * // %, unary minus, cdiv / max / min) and then
    compiled once into bytecode that runs with no builtins. Per launch it costs what `eval` did,
    but a plan can hold nothing except that arithmetic.
"""
import ast
import math
import operator
from functools import lru_cache

MAX_INT_BITS = 1024          # sizes, counts and their products stay far below 2**1024
MAX_LEN = 1 << 20            # items in a list or string an expression builds
MAX_TEXT = 4096              # characters in one plan formula


class ExprLimit(ValueError):
    """An expression outside what is allowed or affordable (the message says which and why)."""


def _bits(x) -> int:
    return abs(x).bit_length() if isinstance(x, int) else 0


def check_result(x):
    """x, if it is a value an expression may produce: no huge integer, no complex number."""
    if isinstance(x, int) and _bits(x) > MAX_INT_BITS:
        raise ExprLimit(f"an integer of {_bits(x)} bits is too large (over {MAX_INT_BITS})")
    if isinstance(x, complex):
        raise ExprLimit(f"{x} is not a real number")
    if isinstance(x, float) and not math.isfinite(x):
        raise ExprLimit(f"the result {x} is not a finite number")
    if isinstance(x, (list, str, tuple)) and len(x) > MAX_LEN:
        raise ExprLimit(f"a {type(x).__name__} of {len(x)} items is too long (over {MAX_LEN})")
    return x


def power(a, b):
    if isinstance(a, int) and isinstance(b, int) and b > 0 and _bits(a) > 1 \
            and (_bits(a) - 1) * b > MAX_INT_BITS:
        raise ExprLimit(f"{a} ** {b} is too large (over {MAX_INT_BITS} bits)")
    return check_result(operator.pow(a, b))


def multiply(a, b):
    seq, n = (a, b) if isinstance(a, (list, str, tuple)) else (b, a)
    if isinstance(seq, (list, str, tuple)) and isinstance(n, int) and len(seq) * max(n, 0) > MAX_LEN:
        raise ExprLimit(f"repeating {len(seq)} items {n} times is too long (over {MAX_LEN} items)")
    if isinstance(a, int) and isinstance(b, int) and _bits(a) + _bits(b) > MAX_INT_BITS + 1:
        raise ExprLimit(f"a product of {_bits(a)}- and {_bits(b)}-bit integers is too large "
                        f"(over {MAX_INT_BITS} bits)")
    return check_result(operator.mul(a, b))


def add(a, b):
    if isinstance(a, (list, str, tuple)) and isinstance(b, (list, str, tuple)) \
            and len(a) + len(b) > MAX_LEN:
        raise ExprLimit(f"joining {len(a)} and {len(b)} items is too long (over {MAX_LEN})")
    return check_result(operator.add(a, b))


def modulo(a, b):
    if isinstance(a, str):          # `str % x` is formatting (`'%*d' % (10**9, 1)`), not arithmetic
        raise ExprLimit("'%' of a string is not supported")
    return check_result(operator.mod(a, b))


# ------------------------------------------------------------------ plan formulas (ints only)

INT_FUNCS = {"cdiv": lambda a, b: -(-a // b), "max": max, "min": min}
_INT_OPS = (ast.Add, ast.Sub, ast.Mult, ast.FloorDiv, ast.Mod)


def _check_int_node(n, text):
    def bad(why):
        raise ExprLimit(f"formula {text!r}: {why} (a plan formula is integer arithmetic over "
                        f"named dims: + - * // %, cdiv, max, min)")
    if isinstance(n, ast.Constant):
        if type(n.value) is not int:
            bad(f"constant {n.value!r} is not an integer")
        if _bits(n.value) > MAX_INT_BITS:
            bad(f"constant of {_bits(n.value)} bits")
    elif isinstance(n, ast.Name):
        if n.id.startswith("_") or n.id in INT_FUNCS:
            bad(f"name {n.id!r} is not a dim")
    elif isinstance(n, ast.BinOp):
        if not isinstance(n.op, _INT_OPS):
            bad(f"operator {type(n.op).__name__} is not allowed")
        _check_int_node(n.left, text)
        _check_int_node(n.right, text)
        return
    elif isinstance(n, ast.UnaryOp):
        if not isinstance(n.op, ast.USub):
            bad(f"operator {type(n.op).__name__} is not allowed")
        _check_int_node(n.operand, text)
        return
    elif isinstance(n, ast.Call):
        if not (isinstance(n.func, ast.Name) and n.func.id in INT_FUNCS) or n.keywords \
                or not n.args or any(isinstance(a, ast.Starred) for a in n.args):
            bad(f"call '{ast.unparse(n)}' is not allowed")
        for a in n.args:
            _check_int_node(a, text)
        return
    else:
        bad(f"'{ast.unparse(n)}' is not allowed")


@lru_cache(maxsize=8192, typed=True)     # typed: 1 and True are different formulas
def compile_int(text: str | int):
    """fn(dims) -> int for an integer formula (an int or its text). Raises ExprLimit for anything
    outside the whitelist; fn raises ExprLimit for a dim it is not given."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = int(text)
        return lambda dims: value
    if not isinstance(text, str) or len(text) > MAX_TEXT:
        raise ExprLimit(f"formula {str(text)[:80]!r} is not a formula string of at most {MAX_TEXT} "
                        f"characters")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise ExprLimit(f"formula {text!r} does not parse ({type(e).__name__})") from None
    try:
        _check_int_node(tree.body, text)
    except RecursionError:
        raise ExprLimit(f"formula {text[:80]!r} is nested too deeply") from None
    code = compile(tree, "<plan formula>", "eval")
    scope = {"__builtins__": {}, **INT_FUNCS}

    def fn(dims):
        try:
            return int(eval(code, scope, dims))    # noqa: S307 - whitelisted arithmetic, no builtins
        except NameError as e:
            raise ExprLimit(f"formula {text!r}: {e.name!r} is not among the dims {sorted(dims)}") from None
        except ArithmeticError as e:          # T // 0: still the plan's fault, named as such
            raise ExprLimit(f"formula {text!r} at {dims}: {e}") from None
    return fn
