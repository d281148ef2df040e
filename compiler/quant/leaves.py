"""The load recipes that read a quantized checkpoint tensor (runtime/weights/quant_*recipes.py),
as checkpoint honesty (compiler/checkpoint_check.py) checks them from the headers alone:

    LEAVES[kind] = (stored dtypes, canonical(src, stored shape) -> the shape the recipe builds)

src[kind] is the tensor's name pattern; canonical() says how a packed format's stored shape
becomes the weight's logical one (the check then compares it with the plan's), or returns a
message when the stored shape cannot be the format's.
"""
from .scheme import MX_BLOCK


def _same(src, shape):
    return tuple(shape)


def _unpacked(src, shape):
    axis, bits, count = src["axis"], src["bits"], src["count"]
    words = -(-count * bits // 32)
    if len(shape) <= axis or shape[axis] != words:
        return (f"has shape {list(shape)}: {count} {bits}-bit values packed along axis {axis} take "
                f"{words} int32 words there")
    return tuple(count if i == axis else d for i, d in enumerate(shape))


def _index(src, shape):
    return tuple(shape) if len(shape) == 1 else f"has shape {list(shape)}: a group index is 1-D [K]"


def _mxfp4(src, shape):
    if len(shape) < 2 or shape[-1] != MX_BLOCK // 2:
        return f"has shape {list(shape)}: MXFP4 blocks are [..., groups, {MX_BLOCK // 2}] bytes"
    return tuple(shape[:-2]) + (shape[-2] * MX_BLOCK,)


def _fp4(src, shape):
    if len(shape) < 1:
        return f"has shape {list(shape)}: fp4 codes are [..., K/2] bytes"
    return tuple(shape[:-1]) + (shape[-1] * 2,)


LEAVES = {
    "fp8": (("F8_E4M3",), _same),
    "unpack": (("I32",), _unpacked),
    "index": (("I32", "I64"), _index),
    "signed": (("I8",), _same),
    "mxfp4": (("U8",), _mxfp4),
    "fp4": (("I8",), _fp4),
    "e8m0": (("U8", "F8_E8M0"), _same),
}
