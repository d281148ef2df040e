"""The quantization math of the fixture writers (tools/quantize_model.py), numpy only: each
format's published definition, checked in tests against the format's own library where it
installs (compressed-tensors)."""
from __future__ import annotations

import zlib

import numpy as np

from infc.compiler.ops.quant import round_e4m3
from infc.compiler.quant.scheme import FP8_MAX, MX_BLOCK
from infc.runtime.weights.quant_int_recipes import AWQ_ORDER
from infc.runtime.weights.quant_pack import E2M1


def rng_for(module: str, seed: int = 0) -> np.random.Generator:
    """A generator per module, so that a fixture is the same however its modules are ordered."""
    return np.random.default_rng([zlib.crc32(module.encode()), seed])


def act_order_gidx(k: int, group: int, rng) -> np.ndarray:
    """GPTQ act-order groups: a random column order, cut into consecutive groups of `group`."""
    perm = rng.permutation(k)
    g = np.empty(k, np.int32)
    g[perm] = np.arange(k) // group
    return g


def int_quantize(w: np.ndarray, bits: int, gidx: np.ndarray, groups: int, sym: bool,
                 scale_dtype=np.float32, zero_range=None):
    """Unsigned codes [N, K], scale [N, G] and zero [N, G] (the implied 2^(bits-1) when sym):
    W ~ (codes - zero) * scale with the group of column k gidx[k]. Symmetric: scale =
    amax / (2^(bits-1) - 1/2) over the group; asymmetric: (max - min) / (2^bits - 1), zero =
    round(-min / scale) (clipped to zero_range, default [0, 2^bits - 1]). Scales are rounded
    to scale_dtype first, as a checkpoint stores them, and the codes computed from those."""
    n, k = w.shape
    top = (1 << bits) - 1
    half = 1 << (bits - 1)
    scale = np.ones((n, groups), np.float32)
    zero = np.full((n, groups), float(half), np.float32)
    lo, hi = zero_range or (0, top)
    for j in range(groups):
        cols = w[:, gidx == j]
        if cols.shape[1] == 0:
            continue
        if sym:
            s = np.abs(cols).max(1) / (half - 0.5)
        else:
            mn, mx = np.minimum(cols.min(1), 0), np.maximum(cols.max(1), 0)
            s = (mx - mn) / top
        s = np.where(s > 0, s, 1.0).astype(scale_dtype).astype(np.float32)
        scale[:, j] = s
        if not sym:
            zero[:, j] = np.clip(np.round(-mn / s), lo, hi)
    z, s = zero[:, gidx], scale[:, gidx]
    codes = np.clip(np.round(w / s) + z, 0, top).astype(np.int64)
    return codes, scale, zero


def pack_words(values: np.ndarray, bits: int, axis: int, order: str = "seq") -> np.ndarray:
    """Unsigned b-bit integers -> int32 words along `axis` (the inverse of
    runtime/weights/quant_int_recipes.unpack_words): element i at bits b*i, padded with zeros;
    order "awq": word j's nibble i holds element 8j + AWQ_ORDER[i]."""
    v = np.moveaxis(np.asarray(values, np.int64), axis, -1)
    per = 32 // bits
    pad = -v.shape[-1] % per
    v = np.concatenate([v, np.zeros(v.shape[:-1] + (pad,), np.int64)], -1) if pad else v
    v = v.reshape(v.shape[:-1] + (-1, per))
    if order == "awq":
        v = v[..., list(AWQ_ORDER)]
    words = (v << (bits * np.arange(per))).sum(-1).astype(np.uint32).view(np.int32)
    return np.ascontiguousarray(np.moveaxis(words, -1, axis))


_STRIP = 1 << 18            # elements quantized at once: the temporaries stay in the cache


def fp8_block_quantize(w: np.ndarray, bn: int, bk: int | None, pow2: bool = False):
    """(e4m3 values [N, K], scale [ceil(N/bn), ceil(K/bk)]): s = amax(block) / 448, q = e4m3(w / s);
    pow2 (scale_fmt ue8m0): s rounded up to a power of two, 2^ceil(log2(amax / 448)).
    Whole strips of row blocks at once (zero-padded to whole blocks: a zero never raises a
    block's amax), with the float32 operations a block at a time would do, element for element.
    bk None: one block spans K (bn = 1: per channel; bn = N: per tensor)."""
    w = np.asarray(w, np.float32)
    n, k = w.shape
    bk = bk or k
    nb, kb = -(-n // bn), -(-k // bk)
    s = np.empty((nb, kb), np.float32)
    q = np.empty((n, k), np.float32)
    step = max(1, _STRIP // (bn * kb * bk))           # row blocks a strip
    for i in range(0, nb, step):
        rows = w[i * bn:(i + step) * bn]
        m = -(-rows.shape[0] // bn)
        padded = np.zeros((m * bn, kb * bk), np.float32)
        padded[:rows.shape[0], :k] = rows
        blocks = padded.reshape(m, bn, kb, bk)
        amax = np.abs(blocks).max(axis=(1, 3))
        si = np.where(amax > 0, amax / np.float32(FP8_MAX), np.float32(1.0)).astype(np.float32)
        if pow2:
            si = np.exp2(np.ceil(np.log2(si))).astype(np.float32)
        s[i:i + m] = si
        q[i * bn:i * bn + rows.shape[0]] = round_e4m3(blocks / si[:, None, :, None]).reshape(m * bn, kb * bk)[:rows.shape[0], :k]
    return q, s


def mxfp4_quantize(w: np.ndarray):
    """(e2m1 codes [N, K] (4-bit, sign in bit 3), e8m0 exponents [N, K/32]): OCP MX: the block's
    scale is 2^(floor(log2 amax) - 2) (e2m1's largest exponent), codes the nearest e2m1 value of
    w / scale, saturating at 6."""
    n, k = w.shape
    blocks = w.reshape(n, k // MX_BLOCK, MX_BLOCK)
    amax = np.abs(blocks).max(-1)
    e = np.where(amax > 0, np.floor(np.log2(np.maximum(amax, 1e-30))) - 2, -127).clip(-127, 127)
    x = blocks / np.exp2(e)[..., None]
    mags = E2M1[:8]
    idx = np.abs(np.abs(x)[..., None] - mags).argmin(-1)
    codes = idx | np.where(np.signbit(x) & (idx > 0), 8, 0)
    return codes.reshape(n, k).astype(np.uint8), (e + 127).astype(np.uint8)
