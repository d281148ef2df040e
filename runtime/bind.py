"""Turning a kernel's META into launch arguments and a grid, for any launcher.

Pure Python, no torch, no CUDA: the GPU runtime and the interpreter test executor both use it,
each with its own way of producing pointers.
"""
import ast
import operator

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}
_FUNCS = {"cdiv": lambda a, b: -(-a // b), "max": max, "min": min}


def eval_int(expr, dims: dict) -> int:
    """Evaluate a grid/scratch expression such as "cdiv(T * 2560, 1024)" over dims."""
    if isinstance(expr, int):
        return expr

    def ev(n):
        if isinstance(n, ast.Constant) and isinstance(n.value, int):
            return n.value
        if isinstance(n, ast.Name):
            return dims[n.id]
        if isinstance(n, ast.BinOp) and type(n.op) in _OPS:
            return _OPS[type(n.op)](ev(n.left), ev(n.right))
        if isinstance(n, ast.Call) and n.func.id in _FUNCS:
            return _FUNCS[n.func.id](*[ev(a) for a in n.args])
        raise ValueError(f"unsupported expression {ast.unparse(n)!r}")

    return int(ev(ast.parse(str(expr), mode="eval").body))


def grid(meta: dict, dims: dict) -> tuple[int, int, int]:
    g = [eval_int(e, dims) for e in meta["grid"]]
    return tuple(g + [1] * (3 - len(g)))


def scratch_sizes(meta: dict, dims: dict) -> dict[str, int]:
    return {name: eval_int(expr, dims) for name, expr in meta.get("scratch", {}).items()}


def split_source(source: str) -> tuple[str, str]:
    kind, _, what = source.partition(":")
    if kind not in ("in", "out", "dim", "meta", "kv", "scratch", "const"):
        raise ValueError(f"unknown parameter source '{source}'")
    return kind, what


def launch_args(meta: dict, resolve) -> list:
    """resolve(kind, what, type) -> the value for each parameter, in order."""
    out = []
    for name, ty, source in meta["params"]:
        kind, what = split_source(source)
        out.append(resolve(kind, what, ty))
    return out
