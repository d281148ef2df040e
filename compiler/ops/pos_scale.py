"""pos_scale(x[T, ...], floor=F, scale=a, shift=s) -> x's type: each token's row times a factor of
its position p (the step's positions, as rope reads them):

    x[t] * (1 + a * log(1 + floor((p_t + s) / F)))

position-dependent query scaling where attention's own `temp_floor` / `temp_scale` cannot reach:
Mistral-Small-4 (get_llama_4_attn_scale: beta = a, original_max_position_embeddings = F, s = 0)
scales its MLA query after RoPE, before the latent attention; Llama-4's attn_temperature_tuning is
s = 1. The factor is computed in f32 and rounded to x's dtype before the multiply (HF's
`.to(query_states.dtype)`); the reference executor runs in f32 throughout.
"""
import numpy as np

from .base import REQUIRED, expect, op


def factor(positions, floor, scale, shift=0) -> np.ndarray:
    """The per-token factor [T] (f32)."""
    p = np.asarray(positions, np.float32)
    return (np.float32(1.0) + np.float32(scale) * np.log1p(np.floor((p + np.float32(shift)) / np.float32(floor)))
            ).astype(np.float32)


def infer(types, attrs):
    (x,) = types
    expect(len(x.shape) >= 2, f"pos_scale expects x[T, ...] (a row a token), got {x}")
    f, a, s = attrs.get("floor"), attrs.get("scale"), attrs.get("shift", 0)
    expect(isinstance(f, (int, float)) and not isinstance(f, bool) and f > 0,
           f"pos_scale floor must be a positive number (original_max_position_embeddings), got {f!r}")
    expect(isinstance(a, (int, float)) and not isinstance(a, bool),
           f"pos_scale scale must be a number (llama_4_scaling_beta), got {a!r}")
    expect(isinstance(s, (int, float)) and not isinstance(s, bool) and s >= 0,
           f"pos_scale shift must be a non-negative number, got {s!r}")
    return [x]


def reference(ctx, x, floor, scale, shift=0):
    f = factor(ctx.positions, floor, scale, shift)
    return x * f.reshape((-1,) + (1,) * (x.ndim - 1))


op(name="pos_scale", tensors=["x"], attrs={"floor": REQUIRED, "scale": REQUIRED, "shift": 0},
   infer=infer, reference=reference, templates={"triton": "pos_scale"},
   doc="x[t] * (1 + scale * log(1 + floor((p_t + shift) / floor))): position-dependent query scale")
