"""Recipes that read a quantized checkpoint's tensors into the canonical form
(compiler/quant/scheme.py): codes as the float32 values they encode, scales and zero points as
float32, group indices as integers (float32 in the numpy loader). The device loader packs codes
to their storage dtype (runtime/weights/quant_pack.py).

    {"fp8": name}                 e4m3 weights (F8_E4M3), as their values
    {"tensor": name, "finite": true}   a float scale of a quantized weight (w_scale, x_scale: the
                                  formats mark them, compiler/quant/format_base.py scale_tensor),
                                  read as any tensor (runtime/weights/recipes.py) and refused when
                                  it holds NaN or infinity, as NaN codes are (check_finite)
    {"rows": src, "count": n}     a per-tensor scale ([] or [1]) repeated for n rows: [n, 1]
    {"row_blocks": src, "block": b, "rows_of": name}   block scales [ceil(N / b), G] repeated to
                                  one row each ([N, G], N the rows of tensor `name`): a quantized
                                  weight whose rows a spec regroups (MLA's q_b_proj cut into its
                                  nope and rope parts) keeps each row's scale
    {"dequantized": {"codes": src, "w_scale": src, ...}, "scheme": attrs}
                                  W by the format's definition (compiler/ops/quant.py dequantize),
                                  float32: a quantized tensor the spec transforms further (MLA's
                                  kv_b_proj cut per head), read as a plain weight
"""
import numpy as np

from infc.compiler.contract.errors import ModelDirError

from infc.compiler.ops.quant import dequantize, scheme_of

from .recipe_registry import build, name_at, recipe, stored


@recipe("fp8")
def _fp8(src, layer, read, where):
    name = name_at(src["fp8"], layer)
    stored(read, name, ("F8_E4M3",), where)
    a = read(name)
    if not np.isfinite(a).all():
        raise ModelDirError(f"{where}: tensor '{name}' holds NaN codes (e4m3 0x7f/0xff)")
    return a, name


def check_finite(a: np.ndarray, name: str, where: str):
    """A quantized weight's float scale (the `tensor` recipe's `finite` mark): a NaN or an infinity
    in it makes every weight it scales NaN or infinite, which no quantizer writes; refused naming
    the tensor, as NaN codes are. Scales are small (a value a block, group or row): one pass."""
    bad = ~np.isfinite(a)
    if bad.any():
        flat = a.reshape(-1)
        i = int(np.flatnonzero(bad.reshape(-1))[0])
        at = [int(j) for j in np.unravel_index(i, a.shape)] if a.ndim else []
        raise ModelDirError(f"{where}: tensor '{name}' holds {int(bad.sum())} NaN or infinite scale(s) of "
                            f"{a.size} (first {flat[i]} at {at}): a quantized weight's scales must be finite")


@recipe("rows")
def _rows(src, layer, read, where):
    a, what = build(src["rows"], layer, read, where)
    if a.size != 1:
        raise ModelDirError(f"{where}: {what} has shape {list(a.shape)}, a per-tensor scale has one element")
    return np.full((src["count"], 1), a.reshape(-1)[0], np.float32), f"{what} (per tensor)"


@recipe("dequantized")
def _dequantized(src, layer, read, where):
    parts, whats = {}, []
    for c, sub in src["dequantized"].items():
        parts[c], what = build(sub, layer, read, where)
        whats.append(what)
    codes, scale = parts["codes"], parts["w_scale"]
    if scale.size == 1:                      # per tensor
        return (codes * scale.reshape(())).astype(np.float32), f"{whats[0]} (dequantized)"
    s = scheme_of({"quant": src["scheme"]})
    want = s.scale_shape(*codes.shape)
    if tuple(scale.shape) != want:
        raise ModelDirError(f"{where}: {whats[1]} has shape {list(scale.shape)}; {whats[0]} "
                            f"{list(codes.shape)} in blocks of {s.block_n}x{s.block_k or 'K'} needs {list(want)}")
    return dequantize(codes, s, scale, parts.get("w_zero"), parts.get("w_gidx")), f"{whats[0]} (dequantized)"


@recipe("row_blocks")
def _row_blocks(src, layer, read, where):
    a, what = build(src["row_blocks"], layer, read, where)
    codes = name_at(src["rows_of"], layer)
    n = read.shape(codes)[0] if hasattr(read, "shape") else read(codes).shape[0]
    if a.ndim != 2 or a.shape[0] * src["block"] < n:
        raise ModelDirError(f"{where}: {what} has shape {list(a.shape)}: too few blocks of {src['block']} "
                            f"rows for the {n} rows of '{codes}'")
    return np.repeat(a, src["block"], axis=0)[:n], f"{what} (a row each)"
