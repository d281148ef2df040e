"""normalize(x[..., D], eps=1e-12) -> x / max(||x||_2, eps) over the last axis: torch's
F.normalize(x, p=2, dim=-1, eps), fp32 math, one rounding to x's dtype.

The three L2-style norms are told apart by name, since they differ where a row is small and by
the eps each model was trained with:
    normalize(x, eps)    x / max(sqrt(sum(x^2)), eps)     F.normalize (sum-style, eps clamps the norm)
    l2_norm(x, eps)      x * rsqrt(sum(x^2) + eps)        FLA's / Qwen3.5's l2norm (ops/linear_attention.py)
    rms_norm(x, eps=e)   x * rsqrt(mean(x^2) + eps)       Llama-4's L2Norm (RMS-style, no weight)
The kernel is l2_norm's template in its normalize form."""
import numpy as np

from .base import expect, op


def _infer(types, attrs):
    (x,) = types
    expect(len(x.shape) >= 1, f"normalize needs at least one axis, got {x}")
    eps = attrs.get("eps", 1e-12)
    expect(isinstance(eps, (int, float)) and not isinstance(eps, bool) and eps >= 0,
           f"normalize eps must be a number >= 0, got {eps!r}")
    return [x]


def normalize(ctx, x, eps=1e-12):
    x = np.asarray(x, np.float32)
    return x / np.maximum(np.sqrt(np.sum(x * x, axis=-1, keepdims=True)), np.float32(eps))


op(name="normalize", tensors=["x"], attrs={"eps": 1e-12}, infer=_infer, reference=normalize,
   templates={"triton": "l2_norm"}, strided=True,
   doc="F.normalize: x / max(||x||_2, eps) over the last axis")
