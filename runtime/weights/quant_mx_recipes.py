"""Recipes for OCP MX checkpoints (GPT-OSS's MXFP4): e2m1 codes in 32-element blocks along K,
one e8m0 power-of-two scale a block.

    {"mxfp4": name}   U8 [..., G, 16]: block g's 32 codes, two a byte, the even element in the low
                      nibble -> their e2m1 values [..., G * 32]
    {"fp4": name}     I8 [..., K/2]: the same codes in a flat layout (fp8's expert_dtype fp4,
                      DeepSeek-V4's experts), two a byte, the even element in the low nibble
                      -> their e2m1 values [..., K]
    {"e8m0": name}    U8 / F8_E8M0 [..., G]: 2^(s - 127) (s = 255 is e8m0's NaN: refused)
"""
import numpy as np

from infc.compiler.contract.errors import ModelDirError
from infc.compiler.contract.safetensors_io import MX_BLOCK

from .quant_pack import E2M1, unpack_nibbles
from .recipe_registry import name_at, recipe, stored


@recipe("mxfp4")
def _mxfp4(src, layer, read, where):
    name = name_at(src["mxfp4"], layer)
    stored(read, name, ("U8",), where)
    raw = np.asarray(read.raw(name))
    if raw.ndim < 2 or raw.shape[-1] != MX_BLOCK // 2:
        raise ModelDirError(f"{where}: tensor '{name}' {list(raw.shape)} is not MXFP4 blocks "
                            f"[..., groups, {MX_BLOCK // 2}]")
    codes = unpack_nibbles(raw, MX_BLOCK)
    return E2M1[codes].reshape(raw.shape[:-2] + (-1,)), name


@recipe("fp4")
def _fp4(src, layer, read, where):
    name = name_at(src["fp4"], layer)
    stored(read, name, ("I8",), where)
    raw = np.asarray(read.raw(name)).view(np.uint8)
    if raw.ndim < 1 or raw.shape[-1] == 0:
        raise ModelDirError(f"{where}: tensor '{name}' {list(raw.shape)} is not fp4 codes [..., K/2]")
    return E2M1[unpack_nibbles(raw, 2 * raw.shape[-1])], name


@recipe("e8m0")
def _e8m0(src, layer, read, where):
    name = name_at(src["e8m0"], layer)
    stored(read, name, ("U8", "F8_E8M0"), where)
    raw = np.asarray(read.raw(name))
    if (raw == 255).any():
        raise ModelDirError(f"{where}: tensor '{name}' holds e8m0 NaN scales (0xff)")
    return np.ldexp(np.float32(1), raw.astype(np.int32) - 127).astype(np.float32), name
