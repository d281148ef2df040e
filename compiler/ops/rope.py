"""rope(x[T, heads, D], theta, scaling) -> x rotated by its token's position (rotate-half form).

inv_freq[j] = theta^(-2j/D); Llama 3 scaling divides low frequencies by `factor` and blends the
band between low_freq_factor and high_freq_factor (as HF's llama3 rope init). Angles are
computed from each token's absolute position, never from a fixed-size table.
"""
import math

import numpy as np

from .base import REQUIRED, expect, op

SUPPORTED = ("default", "llama3")


def check_scaling(scaling):
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind not in SUPPORTED:
        raise ValueError(f"unsupported rope_type '{kind}' (supported: {', '.join(SUPPORTED)})")
    return kind


def inv_freq(dim: int, theta: float, scaling) -> np.ndarray:
    freq = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    if check_scaling(scaling) == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / freq
        scaled = np.where(wavelen > low_wavelen, freq / factor, freq)
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        freq = np.where(is_mid, mid, scaled)
    return freq.astype(np.float32)


def rotate(x, positions, theta, scaling):
    """x[T, heads, D] rotated at positions[T]."""
    d = x.shape[-1]
    ang = positions.astype(np.float32)[:, None] * inv_freq(d, theta, scaling)[None, :]
    cos = np.cos(ang)[:, None, :]
    sin = np.sin(ang)[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def infer(types, attrs):
    (x,) = types
    expect(len(x.shape) == 3 and x.shape[-1] % 2 == 0,
           f"rope expects [T, heads, D] with even D, got {x}")
    try:
        check_scaling(attrs.get("scaling"))
    except ValueError as e:
        expect(False, str(e))
    return [x]


def reference(ctx, x, theta, scaling=None):
    return rotate(x, ctx.positions, theta, scaling)


op(name="rope", tensors=["x"], attrs={"theta": REQUIRED, "scaling": None}, infer=infer,
   reference=reference, templates={},   # fused into qk_norm_rope_cache
   doc="rotary position embedding")
