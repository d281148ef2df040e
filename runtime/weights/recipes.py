"""Weight recipes: how a plan weight's `source` builds it from checkpoint tensors (plan contract 2).

One registry, recipe kind -> builder on numpy arrays, serves the numpy loader (runtime/weights/load.py,
float32) and the device loader (runtime/cuda/weights.py, which streams plain bf16 runs straight
from the files and builds everything else here, then rounds once to bf16, or keeps float32 for
a weight the plan declares f32):

    {"tensor": name}                         a checkpoint tensor ({i} layer, {e} expert)
    {"tensor": name, "finite": true}         the same, NaN or infinity refused (a quantized
                                             weight's scale: runtime/weights/quant_recipes.py)
    {"tied": weight}                         the same storage as another plan weight (loaders alias it)
    {"stack": name, "count": E}              E tensors ({e} = 0..E-1) stacked on a new axis 0
    {"stack": src, "count": E}               E recipes (src with {e} = 0..E-1) stacked on axis 0:
                                             a quantized checkpoint's experts, each read by its
                                             format's recipes (compiler/passes/quantize_weights.py)
    {"concat": [src, ...], "axis": a}        sources concatenated along axis a
    {"slice": src, "axis": a, "start": s, "stop": e}   rows (axis 0) or columns (axis 1) s:e
    {"slice": ..., "axis": 0, "groups": G, ...}   the rows as G equal groups, s:e of each
    {"slice": ..., "step": k, ...}           every k-th of s:e (an interleaved gate|up pair)
                                             (a per-head interleaved projection's parts)
    {"reshape": src, "from": [...], "to": [...]}   a tensor of shape `from` read as `to`
    {"exp": src}                             exp(w) (Qwen3.5's A = -exp(A_log): exp, then scale -1)
    {"transpose": src}                       a 2-D transpose
    {"transpose": src, "per_head": true}     each [n, K] matrix of a 3-D [G, n, K] (-> [G, K, n])
    {"scale": src, "by": x}                  w * x
    {"offset": src, "by": x}                 w + x (RMSNorm weights stored for x * (1 + w))
    {"zeros": [shape...]}                    zeros (a bias a fused concat needs but the model lacks)
    {"derived": {"by": op, "from": [weight, ...], "shape": [...]}}   no checkpoint tensor: the
                                             plan's load program (launches of `by` reading the
                                             plan weights `from`) writes it once before the first
                                             step; loaders only allocate it (zeros here; the GPU
                                             loader builds nothing on the host) and
                                             compiler/checkpoint_check.py expects no tensor

build(src, layer, read) returns (array, what): `what` names the checkpoint tensors for errors.
read(name) -> float32 array (a CheckpointReader, whose raw() and dtype() the quantized formats'
recipes use: runtime/weights/quant_recipes.py). A recipe that does arithmetic (scale, offset)
computes in float32.
"""
import numpy as np

from infc.compiler.contract.errors import ModelDirError

from .recipe_registry import RECIPES, CheckpointReader, build, kind_of, name_at, recipe  # noqa: F401


@recipe("tensor")
def _tensor(src, layer, read, where):
    name = name_at(src["tensor"], layer)
    a = read(name)
    if src.get("finite"):           # a quantized weight's scale (runtime/weights/quant_recipes.py)
        check_finite(a, name, where)
    return a, name


@recipe("tied")
def _tied(src, layer, read, where):
    raise ValueError(f"a tied weight shares '{src['tied']}': loaders alias it, nothing is built")


def _expert(src, e):
    """A recipe with the expert index substituted into every tensor name it holds."""
    if isinstance(src, str):
        return name_at(src, None, e)
    if isinstance(src, dict):
        return {k: _expert(v, e) for k, v in src.items()}
    if isinstance(src, list):
        return [_expert(v, e) for v in src]
    return src


def _experts(src, layer, read, where, start, stop):
    """Experts start .. stop - 1 of a stack recipe, stacked."""
    inner = src["stack"]
    if isinstance(inner, str):
        parts = [read(name_at(inner, layer, e)) for e in range(start, stop)]
        what = name_at(inner, layer)
    else:
        built = [build(_expert(inner, e), layer, read, where) for e in range(start, stop)]
        parts, what = [p for p, _ in built], built[0][1] if built else where
    if len({p.shape for p in parts}) != 1:
        raise ModelDirError(f"{where}: experts of '{what}' differ in shape")
    return np.stack(parts), what


@recipe("stack")
def _stack(src, layer, read, where):
    return _experts(src, layer, read, where, 0, src["count"])


@recipe("concat")
def _concat(src, layer, read, where):
    parts = [build(s, layer, read, where) for s in src["concat"]]
    try:
        return np.concatenate([p for p, _ in parts], axis=src["axis"]), " + ".join(n for _, n in parts)
    except (ValueError, np.exceptions.AxisError):
        shapes = ", ".join(f"{n} {list(p.shape)}" for p, n in parts)
        raise ModelDirError(f"{where}: cannot concatenate {shapes} on axis {src['axis']}") from None


@recipe("slice")
def _slice(src, layer, read, where):
    inner = src["slice"]
    if "stack" in inner and src["axis"] == 0 and src.get("groups", 1) == 1 \
            and 0 <= src["start"] < src["stop"] <= inner["count"]:
        # a rank's experts (expert parallelism): read only those checkpoint tensors
        a, what = _experts(inner, layer, read, where, src["start"], src["stop"])
        return a, f"{what}[{src['start']}:{src['stop']}]"
    a, what = build(inner, layer, read, where)
    axis, start, stop = src["axis"], src["start"], src["stop"]
    groups = src.get("groups", 1)
    if groups > 1:
        if axis != 0 or a.ndim < 1 or a.shape[0] % groups or not 0 <= start < stop <= a.shape[0] // groups:
            raise ModelDirError(f"{where}: cannot take rows [{start}:{stop}] of each of {groups} "
                                f"row groups of {what} {list(a.shape)}")
        g = a.reshape(groups, a.shape[0] // groups, *a.shape[1:])[:, start:stop]
        return (np.ascontiguousarray(g.reshape(groups * (stop - start), *a.shape[1:])),
                f"{what}[{start}:{stop} of each of {groups} row groups]")
    step = src.get("step", 1)
    if not (0 <= axis < a.ndim and 0 <= start < stop <= a.shape[axis]):
        raise ModelDirError(f"{where}: cannot take [{start}:{stop}] of axis {axis} of {what} {list(a.shape)}")
    index = [slice(None)] * a.ndim
    index[axis] = slice(start, stop, step)
    return (np.ascontiguousarray(a[tuple(index)]),
            f"{what}[{'..., ' * axis}{start}:{stop}{f':{step}' if step != 1 else ''}]")


@recipe("reshape")
def _reshape(src, layer, read, where):
    a, what = build(src["reshape"], layer, read, where)
    if list(a.shape) != list(src["from"]):
        raise ModelDirError(f"{where}: {what} has shape {list(a.shape)}, the spec reads it as "
                            f"{src['from']} (its stored_shape)")
    return a.reshape(src["to"]), what


@recipe("exp")
def _exp(src, layer, read, where):
    a, what = build(src["exp"], layer, read, where)
    return np.exp(a.astype(np.float32)), f"exp({what})"


@recipe("transpose")
def _transpose(src, layer, read, where):
    a, what = build(src["transpose"], layer, read, where)
    if src.get("per_head") and a.ndim == 3:     # spec `heads: G` with `transpose: true`
        return np.ascontiguousarray(a.transpose(0, 2, 1)), f"{what} (each head's matrix transposed)"
    if a.ndim != 2:
        raise ModelDirError(f"{where}: cannot transpose {what} {list(a.shape)} (2-D only; 3-D with per_head)")
    return np.ascontiguousarray(a.T), f"{what}.T"


@recipe("scale")
def _scale(src, layer, read, where):
    a, what = build(src["scale"], layer, read, where)
    return a.astype(np.float32) * np.float32(src["by"]), f"{what} * {src['by']}"


@recipe("offset")
def _offset(src, layer, read, where):
    a, what = build(src["offset"], layer, read, where)
    return a.astype(np.float32) + np.float32(src["by"]), f"{what} + {src['by']}"


@recipe("zeros")
def _zeros(src, layer, read, where):
    return np.zeros(src["zeros"], np.float32), f"zeros{list(src['zeros'])}"


@recipe("derived")
def _derived(src, layer, read, where):
    d = src["derived"]
    return np.zeros(d["shape"], np.float32), f"derived by {d['by']} from {', '.join(d['from'])}"


# the quantized formats' recipes register into the same registry
from . import quant_int_recipes, quant_mx_recipes, quant_recipes  # noqa: E402,F401
from .quant_recipes import check_finite  # noqa: E402
