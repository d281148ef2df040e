"""attention(q[T, Hq, D], k[T, Hkv, D], v[T, Hkv, D]) -> [T, Hq, D], causal, GQA.

The new k/v rows join their sequence's KV cache first; each query then attends over its
sequence's cached prefix plus the new tokens up to itself:
    o[i, h] = sum_j softmax_j(q[i, h] . K[j, h // (Hq/Hkv)] * scale) V[j, h // (Hq/Hkv)]
with j <= cached_len + i. scale defaults to 1/sqrt(D).
"""
import numpy as np

from .base import expect, op


def infer(types, attrs):
    q, k, v = types
    expect(len(q.shape) == 3 and len(k.shape) == 3 and k.shape == v.shape,
           f"attention expects q[T, Hq, D], k/v[T, Hkv, D]; got {q}, {k}, {v}")
    expect(q.shape[2] == k.shape[2], f"q head_dim {q.shape[2]} != k head_dim {k.shape[2]}")
    expect(q.shape[1] % k.shape[1] == 0, f"q heads {q.shape[1]} not a multiple of kv heads {k.shape[1]}")
    return [q]


def write_cache(ctx, k, v):
    """Append each sequence's new k/v rows to this layer's cache."""
    for seq_id, start, n, cached in ctx.seqs:
        ctx.kv_append(seq_id, k[start:start + n], v[start:start + n])


def attend_cached(ctx, q, scale=None):
    """Causal GQA attention of q over each sequence's cache (float32)."""
    T, hq, d = q.shape
    scale = scale if scale is not None else 1.0 / np.sqrt(d)
    out = np.empty(q.shape, dtype=np.float32)
    for seq_id, start, n, cached in ctx.seqs:
        K, V = ctx.kv_get(seq_id)
        group = hq // K.shape[1]
        Kh = np.repeat(K, group, axis=1)           # [S, Hq, D]
        Vh = np.repeat(V, group, axis=1)
        s = np.einsum("ihd,jhd->hij", q[start:start + n], Kh) * scale
        qpos = cached + np.arange(n)[:, None]
        mask = np.arange(K.shape[0])[None, :] > qpos
        s = np.where(mask[None], -np.inf, s)
        s = s - s.max(-1, keepdims=True)
        p = np.exp(s)
        p /= p.sum(-1, keepdims=True)
        out[start:start + n] = np.einsum("hij,jhd->ihd", p, Vh)
    return out


def reference(ctx, q, k, v, causal=True, scale=None):
    assert causal, "only causal attention is implemented"
    write_cache(ctx, k, v)
    return attend_cached(ctx, q, scale)


op(name="attention", tensors=["q", "k", "v"], attrs={"causal": True, "scale": None},
   infer=infer, reference=reference,
   # No kernel of its own: fuse_qk_norm_rope_cache turns it into the cache write + attention_cached.
   templates={},
   doc="causal GQA attention; k/v are appended to the paged KV cache")
