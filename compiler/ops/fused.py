"""Ops that only passes create: views that split fused weights' outputs, and fused kernels.

Each fused op's reference is the composition of the spec ops it replaces, so a fusion pass is
correct exactly when the reference executor's logits do not move.
"""
import numpy as np

from .attention import attend_cached, write_cache
from .base import REQUIRED, expect, op, tt
from .elementwise import silu
from .rms_norm import rms
from .rope import rotate


# split(x[..., N], sizes) -> views x[..., a:b] for consecutive sizes (outputs of a fused linear).
def split_infer(types, attrs):
    (x,) = types
    expect(sum(attrs["sizes"]) == x.shape[-1], f"split sizes {attrs['sizes']} do not sum to {x.shape[-1]}")
    return [tt(x.shape[:-1] + (n,), x.dtype) for n in attrs["sizes"]]


def split(ctx, x, sizes):
    cuts = np.cumsum([0] + list(sizes))
    return tuple(x[..., a:b] for a, b in zip(cuts[:-1], cuts[1:]))


op(name="split", tensors=["x"], attrs={"sizes": REQUIRED}, infer=split_infer, reference=split,
   n_outputs=None, view=True, internal=True, doc="views of consecutive column ranges")


# fill_zero(like) -> zeros shaped like `like` (the first layer's pending residual delta).
op(name="fill_zero", tensors=["like"], infer=lambda types, attrs: [types[0]],
   reference=lambda ctx, like: np.zeros_like(like, dtype=np.float32), internal=True,
   templates={"triton": "fill_zero"}, doc="zeros")


# add_rms_norm(x, d, w) -> (x + d, rms_norm(x + d, w)); the sum overwrites x in place.
def add_rms_norm_infer(types, attrs):
    x, d, w = types
    expect(x.shape == d.shape, f"add_rms_norm operands differ: {x} vs {d}")
    return [x, x]


def add_rms_norm(ctx, x, d, w, eps):
    s = x + d
    return s, rms(s, w, eps)


op(name="add_rms_norm", tensors=["x", "delta", "weight"], attrs={"eps": REQUIRED},
   infer=add_rms_norm_infer, reference=add_rms_norm, n_outputs=2, inplace={0: 0},
   internal=True, templates={"triton": "add_rms_norm", "cuda": "add_rms_norm"},
   doc="residual add + RMSNorm")


# qk_norm_rope_cache(qkv[T, (Hq + 2 Hkv) D], [q_norm[D], k_norm[D]]) -> (q[T, Hq, D], kv):
# q = rope(norm(q)); k = rope(norm(k)) and v are written into this layer's KV cache.
def qkrc_infer(types, attrs):
    qkv = types[0]
    hq, hkv, d = attrs["q_heads"], attrs["kv_heads"], attrs["head_dim"]
    expect(qkv.shape[-1] == (hq + 2 * hkv) * d, f"qkv width {qkv.shape[-1]} != (Hq + 2 Hkv) D")
    return [tt((qkv.shape[0], hq, d), qkv.dtype), None]


def qk_norm_rope_cache(ctx, qkv, *norms, q_heads, kv_heads, head_dim, eps, theta, scaling,
                       q_norm, k_norm):
    T = qkv.shape[0]
    d = head_dim
    q = qkv[:, : q_heads * d].reshape(T, q_heads, d)
    k = qkv[:, q_heads * d: (q_heads + kv_heads) * d].reshape(T, kv_heads, d)
    v = qkv[:, (q_heads + kv_heads) * d:].reshape(T, kv_heads, d)
    norms = list(norms)
    if q_norm:
        q = rms(q, norms.pop(0), eps)
    if k_norm:
        k = rms(k, norms.pop(0), eps)
    q = rotate(q, ctx.positions, theta, scaling)
    k = rotate(k, ctx.positions, theta, scaling)
    write_cache(ctx, k, v)
    return q, None


op(name="qk_norm_rope_cache", tensors=["qkv"], internal=True, n_outputs=2,
   attrs={"q_heads": REQUIRED, "kv_heads": REQUIRED, "head_dim": REQUIRED, "eps": 0.0,
          "theta": REQUIRED, "scaling": None, "q_norm": False, "k_norm": False},
   infer=qkrc_infer, reference=qk_norm_rope_cache, templates={"triton": "qk_norm_rope_cache"},
   doc="q/k RMSNorm + RoPE + paged KV write")


# attention_cached(q[T, Hq, D], kv) -> [T, Hq, D] over the cache that `kv` marks as written.
op(name="attention_cached", tensors=["q", "kv"], attrs={"scale": None}, internal=True,
   infer=lambda types, attrs: [types[0]],
   reference=lambda ctx, q, kv, scale=None: attend_cached(ctx, q, scale),
   templates={"triton": {"prefill": "attention_prefill", "mixed": "attention_prefill",
                         "decode": "attention_decode"},
              "tilelang": {"decode": "attention_decode"}},
   doc="causal GQA attention over the paged KV cache")


# silu_mul(gu[..., 2F]) -> silu(gu[..., :F]) * gu[..., F:]
def silu_mul_infer(types, attrs):
    (gu,) = types
    expect(gu.shape[-1] % 2 == 0, f"silu_mul needs an even last dim, got {gu}")
    return [tt(gu.shape[:-1] + (gu.shape[-1] // 2,), gu.dtype)]


def silu_mul(ctx, gu):
    f = gu.shape[-1] // 2
    return silu(gu[..., :f]) * gu[..., f:]


op(name="silu_mul", tensors=["gate_up"], infer=silu_mul_infer, reference=silu_mul, internal=True,
   templates={"triton": "silu_mul"}, doc="SwiGLU activation on a [gate | up] buffer")


# linear_silu_mul(gu[T, 2F], w[N, F]) -> silu_mul(gu) @ w.T; the activation is the GEMM prologue.
def linear_silu_mul_infer(types, attrs):
    gu, w = types
    expect(gu.shape[-1] == 2 * w.shape[1], f"gate_up width {gu.shape[-1]} != 2 x weight K {w.shape[1]}")
    return [tt(gu.shape[:-1] + (w.shape[0],), gu.dtype)]


op(name="linear_silu_mul", tensors=["gate_up", "weight"], infer=linear_silu_mul_infer,
   reference=lambda ctx, gu, w: silu_mul(ctx, gu) @ w.T, internal=True,
   templates={"triton": {"prefill": "gemm_silu_mul", "mixed": "gemm_silu_mul",
                         "decode": "gemv_silu_mul"}},
   doc="down projection with the SwiGLU activation fused into its input load")


# lm_head_last(x[T, H], [d[T, H]], norm[H], w[V, H]) -> f32[B, V]:
# logits of each sequence's last token: rms_norm((x + d)[last]) @ w.T.
def lm_head_infer(types, attrs):
    x, w = types[0], types[-1]
    expect(w.shape[1] == x.shape[-1], f"lm_head K={w.shape[1]} != hidden {x.shape[-1]}")
    return [tt(("B", w.shape[0]), "f32")]


def lm_head_last(ctx, x, *rest, eps, residual):
    rows = ctx.last_rows
    h = x[rows]
    if residual:
        d, rest = rest[0], rest[1:]
        h = h + d[rows]
    norm_w, w = rest
    return (rms(h, norm_w, eps) @ w.T).astype(np.float32)


op(name="lm_head_last", tensors=["x", "norm", "weight"], attrs={"eps": REQUIRED, "residual": False},
   infer=lm_head_infer, reference=lm_head_last, internal=True,
   templates={"triton": "lm_head_last"},
   doc="final residual add + RMSNorm + lm_head on each sequence's last token, f32 logits")
