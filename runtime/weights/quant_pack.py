"""Canonical quantized codes (float32 values, compiler/quant/scheme.py) to the bytes the kernels
read: e4m3 bytes, one code a byte (u8), or two codes a byte along the last axis, the even
column in the low nibble (u4, e2m1)."""
import numpy as np

from infc.compiler.contract.safetensors_io import E4M3

# e2m1 (OCP MX fp4) code -> value; codes 8..15 are the negatives of 0..7
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)

_POS = E4M3[:127]                  # 0x00..0x7e: the non-negative finite values, increasing


def _exact(values: np.ndarray, table: np.ndarray, what: str) -> np.ndarray:
    """The index of each value in an increasing table; values must be table entries."""
    i = np.clip(np.searchsorted(table, values), 0, len(table) - 1)
    if not np.array_equal(table[i], values):
        bad = values[table[i] != values].reshape(-1)[:3]
        raise ValueError(f"values {bad.tolist()} are not {what} codes")
    return i.astype(np.uint8)


def encode_e4m3(values: np.ndarray) -> np.ndarray:
    """e4m3 bytes of values that are e4m3 numbers (exactly). From the float32 bits (a table search
    costs ~40x more: a real-shape checkpoint's billions of codes), checked by decoding back."""
    v = np.asarray(values, np.float32)
    a = np.abs(v)
    bits = a.view(np.uint32)
    # a normal (>= 2^-6): exponent rebiased 127 -> 7, the top 3 mantissa bits; below, the
    # subnormal's count of 2^-9 steps (clipped: anything else fails the check below)
    normal = ((bits >> 23).astype(np.int32) - 120) << 3 | ((bits >> 20) & 7).astype(np.int32)
    with np.errstate(invalid="ignore"):            # NaN / inf: caught by the check
        code = np.where(a >= np.float32(2.0 ** -6), normal, (a * np.float32(512)).astype(np.int32))
    code = np.clip(code, 0, 126).astype(np.uint8)
    if not np.array_equal(_POS[code], a):
        bad = v[_POS[code] != a].reshape(-1)[:3]
        raise ValueError(f"values {bad.tolist()} are not e4m3 codes")
    return code | np.where(np.signbit(v), np.uint8(0x80), np.uint8(0))


def encode_e2m1(values: np.ndarray) -> np.ndarray:
    v = np.asarray(values, np.float32)
    code = _exact(np.abs(v), E2M1[:8], "e2m1")
    return code | np.where(np.signbit(v), np.uint8(8), np.uint8(0))


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """[..., K] codes < 16 -> [..., ceil(K / 2)] bytes, column 2j in the low nibble of byte j."""
    c = np.asarray(codes, np.uint8)
    if c.shape[-1] % 2:
        c = np.concatenate([c, np.zeros(c.shape[:-1] + (1,), np.uint8)], -1)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).astype(np.uint8)


def unpack_nibbles(packed: np.ndarray, k: int) -> np.ndarray:
    p = np.asarray(packed, np.uint8)
    out = np.stack([p & 15, p >> 4], -1).reshape(p.shape[:-1] + (-1,))
    return out[..., :k]


def to_storage(values: np.ndarray, dtype: str) -> np.ndarray:
    """The bytes (uint8, C order) of canonical codes stored as `dtype`."""
    v = np.asarray(values, np.float32)
    if dtype == "f8e4m3":
        return encode_e4m3(v)
    if dtype == "e2m1":
        return pack_nibbles(encode_e2m1(v))
    if dtype in ("u4", "u8"):
        top = 15 if dtype == "u4" else 255
        if v.size and (v.min() < 0 or v.max() > top or not np.array_equal(v, np.round(v))):
            raise ValueError(f"{dtype} codes must be integers in [0, {top}]")
        return pack_nibbles(v) if dtype == "u4" else v.astype(np.uint8)
    raise ValueError(f"not a quantized code dtype: {dtype}")
