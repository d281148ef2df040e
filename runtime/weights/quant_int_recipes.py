"""Recipes for integer-quantized checkpoints (GPTQ, AWQ, compressed-tensors pack-quantized): codes
and zero points packed in int32 words, and GPTQ's group index.

    {"unpack": name, "bits": b, "axis": a, "count": c}   an I32 tensor whose axis a packs 32/b
        unsigned b-bit integers a word, element i at bits b*i of the little-endian bit stream
        (GPTQ, compressed-tensors); the first c of them along that axis, as float32 values
    {..., "order": "awq"}                 AWQ's GEMM packing: word j's nibble i holds element
                                          8j + AWQ_ORDER[i]
    {"index": name, "groups": g}          an I32 [K] group index (GPTQ's g_idx), each in [0, g)
    {"signed": name, "bits": b}           an I8 tensor of signed b-bit integers, offset by 2^(b-1)
                                          to the unsigned codes (compressed-tensors naive-quantized)

Shapes are checked from the headers by compiler/quant/leaves.py.
"""
import numpy as np

from infc.compiler.contract.errors import ModelDirError

from .recipe_registry import name_at, recipe, stored

# AutoAWQ's GEMM pack order: nibble i of a word holds column AWQ_ORDER[i] of its 8
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_AWQ_NIBBLE_OF = np.argsort(AWQ_ORDER)          # column c sits in nibble _AWQ_NIBBLE_OF[c]


def unpack_words(words: np.ndarray, bits: int, axis: int, count: int, order: str = "seq") -> np.ndarray:
    """int32 words -> the unsigned integers they pack along `axis` (uint8), `count` of them."""
    w = np.moveaxis(np.asarray(words), axis, -1)
    b = np.ascontiguousarray(w).astype("<i4").view(np.uint8)       # the bit stream, byte by byte
    if bits == 4:
        v = np.stack([b & 15, b >> 4], -1).reshape(b.shape[:-1] + (-1,))
    elif bits == 8:
        v = b
    else:
        raise ValueError(f"{bits}-bit packing is not read (4 or 8)")
    if order == "awq":
        v = v.reshape(v.shape[:-1] + (-1, 8))[..., _AWQ_NIBBLE_OF].reshape(v.shape)
    return np.moveaxis(v[..., :count], -1, axis)


@recipe("unpack")
def _unpack(src, layer, read, where):
    name = name_at(src["unpack"], layer)
    stored(read, name, ("I32",), where)
    raw = read.raw(name)
    axis, count, bits = src["axis"], src["count"], src["bits"]
    if raw.ndim <= axis or raw.shape[axis] * 32 // bits < count:
        raise ModelDirError(f"{where}: tensor '{name}' {list(raw.shape)} does not pack {count} {bits}-bit "
                            f"values along axis {axis}")
    return unpack_words(raw, bits, axis, count, src.get("order", "seq")).astype(np.float32), name


@recipe("index")
def _index(src, layer, read, where):
    name = name_at(src["index"], layer)
    stored(read, name, ("I32", "I64"), where)
    a = np.asarray(read.raw(name))
    if a.size and (a.min() < 0 or a.max() >= src["groups"]):
        raise ModelDirError(f"{where}: tensor '{name}' names groups {int(a.min())}..{int(a.max())}; the "
                            f"weight has {src['groups']} (0..{src['groups'] - 1})")
    return a.astype(np.float32), name


@recipe("signed")
def _signed(src, layer, read, where):
    name = name_at(src["signed"], layer)
    stored(read, name, ("I8",), where)
    a = np.asarray(read.raw(name)).astype(np.int32)
    half = 1 << (src["bits"] - 1)
    if a.size and (a.min() < -half or a.max() >= half):
        raise ModelDirError(f"{where}: tensor '{name}' holds {int(a.min())}..{int(a.max())}, outside the "
                            f"{src['bits']}-bit range [{-half}, {half - 1}]")
    return (a + half).astype(np.float32), name
