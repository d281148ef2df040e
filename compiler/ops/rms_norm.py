"""rms_norm(x[..., N], w[N], eps) -> x / sqrt(mean(x^2) + eps) * w over the last axis.

Any leading shape: [T, H], [B, H], [T, heads, D] (per-head q/k norm). The kernel reads a
row-strided x (a column slice of a fused projection) directly, so it needs no copy.

The weight may be left out (`rms_norm(x, eps=e)`): x / sqrt(mean(x^2) + eps), rounded once
(attrs has_weight False). That is the RMS-style L2 norm, Llama-4's L2Norm on q/k
(`x * rsqrt(x.pow(2).mean(-1) + eps)`), as distinct from l2_norm's sum-style
x * rsqrt(sum(x^2) + eps) and normalize's x / max(||x||, eps) (ops/normalize.py). The fusions
that fold a norm's weight into another launch (add_rms_norm, qk_norm_rope_cache, lm_head_last,
latent_prologue) take only norms with a weight; a weightless one runs this op's kernel."""
import numpy as np

from .base import REQUIRED, expect, expect_eps, op


def infer(types, attrs):
    x, *w = types
    expect_eps("rms_norm", attrs.get("eps"))
    expect(len(w) == (1 if attrs.get("has_weight", True) else 0),
           f"rms_norm: {len(types)} tensors for has_weight={attrs.get('has_weight', True)}")
    expect(not w or (len(w[0].shape) == 1 and w[0].shape[0] == x.shape[-1]),
           f"norm weight {w[0] if w else None} does not match the last dim of {x}")
    return [x]


def rms(x, w, eps):
    x = x.astype(np.float32)
    var = np.mean(x * x, axis=-1, keepdims=True)
    n = x / np.sqrt(var + eps)
    return n if w is None else n * w


def reference(ctx, x, *w, eps, has_weight=True):
    return rms(x, w[0] if has_weight else None, eps)


def has_weight(node) -> bool:
    """Whether a norm node multiplies by a weight (the fusions that fold it in need one)."""
    return node.attrs.get("has_weight", True)


op(name="rms_norm", tensors=["x"], omittable=["weight"], attrs={"eps": REQUIRED}, infer=infer,
   reference=reference, templates={"triton": "rms_norm"}, strided=True,
   doc="RMSNorm over the last axis, weight optional")
