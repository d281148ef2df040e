"""rms_norm(x[..., N], w[N], eps) -> x / sqrt(mean(x^2) + eps) * w over the last axis.

Any leading shape: [T, H], [B, H], [T, heads, D] (per-head q/k norm). The kernel reads a
row-strided x (a column slice of a fused projection) directly, so it needs no copy."""
import numpy as np

from .base import REQUIRED, expect, op


def infer(types, attrs):
    x, w = types
    expect(len(w.shape) == 1 and w.shape[0] == x.shape[-1],
           f"norm weight {w} does not match the last dim of {x}")
    return [x]


def rms(x, w, eps):
    x = x.astype(np.float32)
    var = np.mean(x * x, axis=-1, keepdims=True)
    return (x / np.sqrt(var + eps)) * w


def reference(ctx, x, w, eps):
    return rms(x, w, eps)


op(name="rms_norm", tensors=["x", "weight"], attrs={"eps": REQUIRED}, infer=infer,
   reference=reference, templates={"triton": "rms_norm"}, strided=True, doc="RMSNorm over the last axis")
