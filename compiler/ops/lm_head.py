"""lm_head_last: the model's last step, fused (only the fuse_lm_head pass creates it).

    lm_head_last(x[T, H], [d[T, H]], norm[H], w[V, H], [b[V]]) -> f32 logits[B, V]:
        h      = rms_norm((x + d)[last_rows], norm, eps)       (d when attrs.residual)
        logits = h @ w.T (+ b)                                  (b when attrs.has_bias)
        logits = cap * tanh(logits / cap)                       (when attrs.softcap = cap;
                                                                 Gemma2's final_logit_softcapping)
Only each sequence's last token goes through the final norm and the vocabulary projection.
The norm is RMSNorm: fuse_lm_head matches rms_norm only.
"""
import numpy as np

from .base import REQUIRED, expect, op, tt
from .rms_norm import rms


def lm_head_infer(types, attrs):
    n_w = len(types) - 1 - bool(attrs.get("has_bias"))
    x, w = types[0], types[n_w]
    expect(w.shape[1] == x.shape[-1], f"lm_head K={w.shape[1]} != hidden {x.shape[-1]}")
    if attrs.get("has_bias"):
        expect(types[-1].shape == (w.shape[0],), f"lm_head bias must be [{w.shape[0]}], got {types[-1]}")
    cap = attrs.get("softcap")
    expect(cap is None or cap > 0, f"lm_head softcap must be positive, got {cap}")
    return [tt(("B", w.shape[0]), "f32")]


def lm_head_last(ctx, x, *rest, eps, residual, softcap=None, has_bias=False):
    rows = ctx.last_rows
    h = x[rows]
    if residual:
        d, rest = rest[0], rest[1:]
        h = h + d[rows]
    norm_w, w = rest[:2]
    y = rms(h, norm_w, eps) @ w.T
    if has_bias:
        y = y + rest[2]
    if softcap is not None:
        y = softcap * np.tanh(y / softcap)
    return y.astype(np.float32)


op(name="lm_head_last", tensors=["x", "norm", "weight"], optional=["bias"],
   attrs={"eps": REQUIRED, "residual": False, "softcap": None, "has_bias": False},
   infer=lm_head_infer, reference=lm_head_last, internal=True,
   templates={"triton": "lm_head_last"},
   doc="final residual add + RMSNorm + lm_head (+ bias, softcap) on each sequence's last token, "
       "f32 logits")
