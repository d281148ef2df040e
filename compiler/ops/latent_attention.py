"""Multi-head latent attention (DeepSeek-V2/V3 MLA) in its absorbed form, and the per-head linear
that absorbs kv_b_proj into the query and the output.

latent_attention(q[T, H, Dc + Dr], kv[T, Dc + Dr], scale, rope_dim=Dr) -> [T, H, Dc]
  The paged cache `latent` holds one row of Dc + Dr values per token (the kv_a_layernorm'd c_kv
  followed by the roped k_pe; 576 for V2-Lite), shared by every head (MQA with one latent kv head).
  The step's kv rows are written to their slots (slot_mapping) first; then for query i of a
  sequence with `cached` tokens before this step (position p = cached + i) and its latent rows
  Lat[j] = latent_cache[block_tables[b, j // page], j % page], j <= p:
      s_j = (q[h] . Lat[j]) * scale          over all Dc + Dr dims
      o[h] = sum_j softmax_j(s) Lat[j, :Dc]  (the values are the latent's first Dc dims)
  scale is required: DeepSeek's is (qk_nope_head_dim + qk_rope_head_dim) ** -0.5, times
  yarn mscale(factor, mscale_all_dim) ** 2 when YaRN rope is configured, not a function of Dc.

head_linear(x[T, H, K], w[H, N, K]) -> [T, H, N]:  y[t, h] = w[h] @ x[t, h]  (batched over heads)
  Absorption (HF DeepseekV2Attention; Dn = qk_nope_head_dim, Dv = v_head_dim, Dc = kv_lora_rank):
    Wb = kv_b_proj.weight.reshape(H, Dn + Dv, Dc)       (rows h * (Dn + Dv) + [0, Dn + Dv))
    W_uk[h] = Wb[h, :Dn, :]   [Dn, Dc]:  k_nope[h] = W_uk[h] @ c_kv
    W_uv[h] = Wb[h, Dn:, :]   [Dv, Dc]:  v[h]      = W_uv[h] @ c_kv
    q_lat  = head_linear(q_nope, W_uk.transpose(0, 2, 1))   w [H, Dc, Dn]: q_nope . k_nope = q_lat . c_kv
    o      = head_linear(o_lat,  W_uv)                      w [H, Dv, Dc]
"""
import numpy as np

from .base import REQUIRED, expect, op, tt


# -- latent_attention ---------------------------------------------------------------------------

def _latent_cache(width):
    return {"latent": {"kind": "paged", "shape": [width], "dtype": "bf16"}}


def write_rows(ctx, name, kv):
    """Paged write into cache `name` (one row a token): row t of kv goes to slot slot_mapping[t]
    (rows with a slot < 0 are padding)."""
    slots = np.asarray(ctx.meta.slot_mapping[: kv.shape[0]], np.int64)
    ok = slots >= 0
    cache = ctx.cache(name)
    ps = cache.shape[1]
    cache[slots[ok] // ps, slots[ok] % ps] = np.asarray(kv, np.float32)[ok]


def read_rows(ctx, name, b, n):
    """The first n cached rows of batch row b in cache `name`: [n, width]."""
    cache = ctx.cache(name)
    ps = cache.shape[1]
    pages = np.asarray(ctx.meta.block_tables[b, : -(-n // ps)], np.int64)
    return cache[pages].reshape(-1, cache.shape[2])[:n]


def attend_latent(ctx, q, scale, rope_dim):
    """Causal absorbed MLA of q[T, H, Dc + Dr] over each sequence's latent cache (float32)."""
    T, h, d = q.shape
    dc = d - rope_dim
    out = np.zeros((T, h, dc), dtype=np.float32)
    for b, start, n, cached in ctx.seqs:
        L = cached + n
        lat = read_rows(ctx, "latent", b, L)                                   # [L, D]
        s = np.einsum("ihd,jd->hij", np.asarray(q[start:start + n], np.float32), lat) * np.float32(scale)
        hidden = np.arange(L)[None, :] > cached + np.arange(n)[:, None]
        s = np.where(hidden[None], -np.inf, s)
        s = s - s.max(-1, keepdims=True)
        p = np.exp(s)
        p /= p.sum(-1, keepdims=True)
        out[start:start + n] = np.einsum("hij,jd->ihd", p, lat[:, :dc])
    return out


def latent_infer(types, attrs):
    q, kv = types
    expect(len(q.shape) == 3 and len(kv.shape) == 2,
           f"latent_attention expects q[T, H, Dc + Dr], kv[T, Dc + Dr]; got {q}, {kv}")
    expect(q.shape[2] == kv.shape[1], f"q width {q.shape[2]} != latent width {kv.shape[1]}")
    r = attrs.get("rope_dim")
    expect(isinstance(r, int) and 0 <= r < q.shape[2],
           f"latent_attention rope_dim must be an int in [0, {q.shape[2]}), got {r}")
    s = attrs.get("scale")
    expect(isinstance(s, (int, float)) and s > 0, f"latent_attention scale must be positive, got {s}")
    return [tt((q.shape[0], q.shape[1], q.shape[2] - r), q.dtype)]


def latent_reference(ctx, q, kv, scale, rope_dim):
    write_rows(ctx, "latent", kv)
    return attend_latent(ctx, q, scale, rope_dim)


op(name="latent_attention", tensors=["q", "kv"],
   attrs={"scale": REQUIRED, "rope_dim": REQUIRED},
   infer=latent_infer, reference=latent_reference,
   caches=lambda types, attrs: _latent_cache(types[1].shape[1]),
   templates={"triton": {"prefill": "latent_attention_prefill", "mixed": "latent_attention_prefill",
                         "short": "latent_attention_prefill", "decode": "latent_attention_decode"}},
   doc="absorbed multi-head latent attention (DeepSeek MLA): writes the step's latent rows, then "
       "every head attends causally over its sequence's paged latent cache (values = first Dc dims)")


# -- head_linear --------------------------------------------------------------------------------

def head_linear_infer(types, attrs):
    x, w = types
    expect(len(x.shape) == 3 and len(w.shape) == 3,
           f"head_linear expects x[T, H, K], w[H, N, K]; got {x}, {w}")
    expect(x.shape[1] == w.shape[0] and x.shape[2] == w.shape[2],
           f"head_linear: x {x.shape} and w {w.shape} disagree on heads or K")
    return [tt((x.shape[0], x.shape[1], w.shape[1]), x.dtype)]


def head_linear_reference(ctx, x, w):
    return np.einsum("thk,hnk->thn", np.asarray(x, np.float32), np.asarray(w, np.float32))


op(name="head_linear", tensors=["x", "w"], infer=head_linear_infer, reference=head_linear_reference,
   templates={"triton": "head_linear"}, strided=True,
   doc="per-head linear y[t, h] = w[h] @ x[t, h] (MLA's absorbed W_uk / W_uv)")
