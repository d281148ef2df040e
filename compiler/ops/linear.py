"""linear(x[..., K], w[N, K], b[N] optional) -> x @ w.T (+ b), fp32 accumulate.

The rows are whatever x's leading dims are: [T, K] tokens, [B, K] after last(), or
[T, n, K] (T * n rows). The output is x's dtype, or f32 when it is the model's logits or when
attrs["out_dtype"] says so: a row-parallel linear (compiler/passes/shard_ranks.py) writes its
partial sum in fp32, and the all_reduce after it rounds the ranks' sum once. A bias is
added in fp32 in the kernel's epilogue, before the one rounding to the output dtype: torch's
addmm (what HF's nn.Linear runs on the GPU) adds it inside the GEMM the same way.

Decode steps have few rows, so they stream the weight with a split-K GEMV, and so do short
prefill/mixed steps (T <= SHORT_TOKENS, the "short" phase); prefill uses tiled GEMM. The choice is
per phase, made by the select_kernels pass. The cuda gemv and the tilelang
gemm take no bias, and no quantized weight.
"""
from .base import expect, op, tt
from .quant import CODES_OPTIONAL, check_types, operands


def infer(types, attrs):
    x, w = types[:2]
    expect(len(w.shape) == 2, f"linear weight must be 2-D [N, K], got {w}")
    expect(x.shape[-1] == w.shape[1], f"linear: input {x} has K={x.shape[-1]} but weight {w} "
                                      f"has K={w.shape[1]}")
    if attrs.get("has_bias"):
        expect(len(types) >= 3 and types[2].shape == (w.shape[0],),
               f"linear: bias must be [{w.shape[0]}] (one per output column), got {types[2:3]}")
    check_types(types, attrs, 3 if attrs.get("has_bias") else 2, "linear")
    return [tt(x.shape[:-1] + (w.shape[0],), out_dtype(x, attrs))]


def out_dtype(x, attrs) -> str:
    """x's dtype, unless a pass set attrs["out_dtype"] (fp32 partial sums of a row-parallel linear)."""
    # ready activation codes (attrs.has_a_scale) stand for the bf16 activations they were made from
    d = attrs.get("out_dtype") or ("bf16" if x.dtype == "f8e4m3" else x.dtype)
    expect(d in ("bf16", "f32"), f"linear: out_dtype must be bf16 or f32, got {d!r}")
    return d


def reference(ctx, x, w, *rest, out_dtype=None, **attrs):
    x, w, bias = operands(x, w, rest, attrs)
    y = x @ w.T
    return y if bias is None else y + bias


# attrs["has_bias"] is set by whoever makes the node (lowering, passes), as for every optional
# A quantized checkpoint's linear (compiler/passes/quantize_weights.py) reads W as codes and its
# scales after the bias (compiler/ops/quant.py): attrs["quant"] names the scheme.
op(name="linear", tensors=["x", "weight"], optional=["bias"], pass_inputs=CODES_OPTIONAL,
   infer=infer, reference=reference,
   # wide (decode steps of >= WIDE_DENSE_TOKENS sequences): the GEMM's decode tiles, which read
   # W once for 64 rows a tile where the GEMV re-reads it per row block (bench/NOTES.md)
   templates={"triton": {"prefill": "gemm", "mixed": "gemm", "decode": "gemv", "short": "gemv", "wide": "gemm"},
              "cuda": {"decode": "gemv"},
              "tilelang": {"prefill": "gemm", "mixed": "gemm"}},
   doc="y = x W^T (+ b)")
