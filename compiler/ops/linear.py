"""linear(x[..., K], w[N, K]) -> x @ w.T, fp32 accumulate.

Decode steps have few rows, so they stream the weight with a split-K GEMV; prefill uses tiled
GEMM. The choice is per phase, made by the select_kernels pass.
"""
from .base import expect, op, tt


def infer(types, attrs):
    x, w = types
    expect(len(w.shape) == 2, f"linear weight must be 2-D [N, K], got {w}")
    expect(x.shape[-1] == w.shape[1], f"linear: input {x} has K={x.shape[-1]} but weight {w} "
                                      f"has K={w.shape[1]}")
    return [tt(x.shape[:-1] + (w.shape[0],), x.dtype)]


def reference(ctx, x, w):
    return x @ w.T


op(name="linear", tensors=["x", "weight"], infer=infer, reference=reference,
   templates={"triton": {"prefill": "gemm", "mixed": "gemm", "decode": "gemv"},
              "cuda": {"decode": "gemv"},
              "tilelang": {"prefill": "gemm", "mixed": "gemm"}},
   doc="y = x W^T")
