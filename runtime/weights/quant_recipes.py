"""Recipes that read a quantized checkpoint's tensors into the canonical form
(compiler/quant/scheme.py): codes as the float32 values they encode, scales and zero points as
float32, group indices as integers (float32 in the numpy loader). The device loader packs codes
to their storage dtype (runtime/weights/quant_pack.py).

    {"fp8": name}                 e4m3 weights (F8_E4M3), as their values
    {"rows": src, "count": n}     a per-tensor scale ([] or [1]) repeated for n rows: [n, 1]
"""
import numpy as np

from infc.compiler.contract.errors import ModelDirError

from .recipe_registry import build, name_at, recipe, stored


@recipe("fp8")
def _fp8(src, layer, read, where):
    name = name_at(src["fp8"], layer)
    stored(read, name, ("F8_E4M3",), where)
    a = read(name)
    if not np.isfinite(a).all():
        raise ModelDirError(f"{where}: tensor '{name}' holds NaN codes (e4m3 0x7f/0xff)")
    return a, name


@recipe("rows")
def _rows(src, layer, read, where):
    a, what = build(src["rows"], layer, read, where)
    if a.size != 1:
        raise ModelDirError(f"{where}: {what} has shape {list(a.shape)}, a per-tensor scale has one element")
    return np.full((src["count"], 1), a.reshape(-1)[0], np.float32), f"{what} (per tensor)"
