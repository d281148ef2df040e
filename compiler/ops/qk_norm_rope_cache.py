"""qk_norm_rope_cache(qkv[T, W], [q_norm[D]], [k_norm[D]]) -> (q[T, Hq, D], cache).

qkv's first (Hq + 2 Hkv) D columns are [q | k | v]; a wider row (W more) holds other columns of
the same fused projection after them (Qwen3.5's output gate), which this op does not read.

The fused attention prologue (made by fuse_qk_norm_rope_cache from split -> view -> [rms_norm]
-> rope of q and k, view of v, and kv_write): for each token t at position p with slot s,
    q[t]   = rope(rms_norm(q_t, q_norm) if q_norm else q_t, p)
    K[s]   = rope(rms_norm(k_t, k_norm) if k_norm else k_t, p)     paged cache `k`
    V[s]   = v_t                                                     paged cache `v`
rope as in ops/rope.py (rotary_dim, default / linear / llama3 / yarn). Its reference is the
composition of those ops' references, so the fusion is correct exactly when logits do not move.
"""
from .attention import _kv_caches, write_kv
from .base import REQUIRED, expect, op, tt
from .rms_norm import rms
from .rope import check as check_rope
from .rope import rotate


def infer(types, attrs):
    qkv = types[0]
    hq, hkv, d = attrs["q_heads"], attrs["kv_heads"], attrs["head_dim"]
    expect(isinstance(qkv.shape[-1], int) and qkv.shape[-1] >= (hq + 2 * hkv) * d,
           f"qkv width {qkv.shape[-1]} < (Hq + 2 Hkv) D")
    check_rope(d, attrs)
    return [tt((qkv.shape[0], hq, d), qkv.dtype), None]


def reference(ctx, qkv, *norms, q_heads, kv_heads, head_dim, eps, theta, scaling, q_norm, k_norm,
              rotary_dim=None):
    T, d = qkv.shape[0], head_dim
    q = qkv[:, : q_heads * d].reshape(T, q_heads, d)
    k = qkv[:, q_heads * d: (q_heads + kv_heads) * d].reshape(T, kv_heads, d)
    v = qkv[:, (q_heads + kv_heads) * d:(q_heads + 2 * kv_heads) * d].reshape(T, kv_heads, d)
    norms = list(norms)
    if q_norm:
        q = rms(q, norms.pop(0), eps)
    if k_norm:
        k = rms(k, norms.pop(0), eps)
    q = rotate(q, ctx.positions, theta, scaling, rotary_dim)
    k = rotate(k, ctx.positions, theta, scaling, rotary_dim)
    write_kv(ctx, k, v)
    return q, None


op(name="qk_norm_rope_cache", tensors=["qkv"], internal=True, n_outputs=2,
   attrs={"q_heads": REQUIRED, "kv_heads": REQUIRED, "head_dim": REQUIRED, "eps": 0.0,
          "theta": REQUIRED, "scaling": None, "rotary_dim": None, "q_norm": False, "k_norm": False},
   infer=infer, reference=reference,
   caches=lambda types, attrs: _kv_caches(attrs["kv_heads"], attrs["head_dim"]),
   templates={"triton": "qk_norm_rope_cache"},
   doc="q/k RMSNorm + RoPE + paged KV write")
