"""Causal GQA attention over the paged KV cache: the spec op and the two ops it lowers into.

attention(q[T, Hq, D], k[T, Hkv, D], v[T, Hkv, D], sinks[Hq] optional, causal=True, scale=None,
          window=None, softcap=None)
  is what a spec writes; the required pass split_attention lowers it into
kv_write(k, v) -> cache            the new rows join their sequence's paged caches `k` and `v`
attention_cached(q, cache, ...)    each query attends over its sequence's cache, up to itself
(the fused path writes the cache from qk_norm_rope_cache instead of kv_write).

For query i of a sequence with `cached` tokens before this step (position p = cached + i) and its
cached keys j = 0 .. cached + n - 1 (K[j] = k_cache[block_tables[b, j // page], j % page]):
    s_j = (q . K[j, h // G]) * scale                 scale defaults to 1/sqrt(D), G = Hq / Hkv
    s_j = softcap * tanh(s_j / softcap)               when softcap is set (Gemma 2's attention
                                                      logit softcapping), before masking
    key j is visible iff j <= p and (window is None or p - j < window)
                                                      (HF's sliding_window overlay:
                                                      kv_idx > q_idx - sliding_window)
    o = sum_j softmax_j(s) V[j, h // G]
    with sinks (GPT-OSS's learned per-head attention sinks): one more logit sinks[h] joins the
    softmax's denominator only (no value row): o = sum_j e^(s_j) V[j] / (e^(sinks[h]) + sum_j e^(s_j)),
    so a head can put weight "nowhere"; the sink is neither scaled nor soft-capped
    (transformers' eager_attention_forward concatenates it to the scaled, masked scores).
    sinks is an extra optional input (base.OpDef.extra_optional): plans without it are unchanged.
The attrs below are extra attrs (base.OpDef.extra_attrs): a node carries one only where its spec
gives it, so every other plan is unchanged.
    alibi=true | M    ALiBi (BLOOM, MPT): s_j += slope[h] * (j - p), the slopes from the head
                      count (alibi_slopes: M = 8 for true, MPT's alibi_bias_max otherwise); added
                      after scale and softcap. Softmax is shift-invariant, so this is BLOOM's
                      slope * j and MPT's slope * (j - L + 1) too.
    chunk=C           block-local attention (Llama-4's attention_chunk_size): key j is visible
                      from position p only within p's chunk, j // C == p // C (with a window too,
                      both must hold). Positions are absolute, so a cached prefix changes nothing.
    temp_floor=F, temp_scale=a
                      position-dependent query scaling (Llama-4's attn_temperature_tuning):
                      q[p] *= log(floor((p + 1) / F) + 1) * a + 1 before the scores (so before
                      the scale, the softcap and everything else; q stays in its dtype as HF's
                      `.to(dtype)` keeps it).
"""
import numpy as np

from ..contract import caches as cache_layout
from .base import REQUIRED, expect, op
from .pos_scale import factor as pos_factor
from .quant import round_e4m3


def _kv_caches(kv_heads, head_dim):
    entry = {"kind": "paged", "shape": [kv_heads, head_dim], "dtype": "bf16"}
    return {"k": dict(entry), "v": dict(entry)}


# extra attrs (base.OpDef.extra_attrs): absent from every plan whose spec does not give them
EXTRA_ATTRS = {"alibi": None, "chunk": None, "temp_floor": None, "temp_scale": None}
# alibi=true: BLOOM's (and MPT's default alibi_bias_max) largest bias exponent
ALIBI_MAX = 8.0


def alibi_max(alibi) -> float | None:
    """The ALiBi max bias of an `alibi` attr: true -> 8 (BLOOM), a number -> itself (MPT's
    alibi_bias_max), None / false -> None (no ALiBi)."""
    if alibi is None or alibi is False:
        return None
    return ALIBI_MAX if alibi is True else float(alibi)


def alibi_slopes(hq: int, max_bias: float = ALIBI_MAX) -> np.ndarray:
    """ALiBi's per-head slopes (f32 [hq]), as BLOOM's build_alibi_tensor and MPT's gen_slopes
    (the two agree): with c = 2^floor(log2 hq), head h < c gets 2^(-M (h + 1) / c), and the
    others interleave the next power's odd terms, head c + i gets 2^(-M (2 i + 1) / (2 c))."""
    c = 1 << (int(hq).bit_length() - 1)
    h = np.arange(hq, dtype=np.float64)
    e = np.where(h < c, (h + 1) / c, (2 * (h - c) + 1) / (2 * c))
    return (2.0 ** (-max_bias * e)).astype(np.float32)


def _check_attrs(attrs):
    scale, window, softcap = attrs.get("scale"), attrs.get("window"), attrs.get("softcap")
    expect(scale is None or scale > 0, f"attention scale must be positive, got {scale}")
    expect(window is None or (int(window) == window and window >= 1),
           f"attention window must be a positive integer (HF's sliding_window), got {window}")
    expect(softcap is None or softcap > 0, f"attention softcap must be positive, got {softcap}")
    alibi, chunk = attrs.get("alibi"), attrs.get("chunk")
    expect(alibi is None or isinstance(alibi, bool) or
           (isinstance(alibi, (int, float)) and alibi > 0),
           f"attention alibi must be true or a positive max bias (MPT's alibi_bias_max), got {alibi!r}")
    expect(chunk is None or (not isinstance(chunk, bool) and isinstance(chunk, (int, float))
                             and int(chunk) == chunk and chunk >= 1),
           f"attention chunk must be a positive integer (Llama-4's attention_chunk_size), got {chunk!r}")
    tf, ts = attrs.get("temp_floor"), attrs.get("temp_scale")
    expect((tf is None) == (ts is None),
           "attention temp_floor and temp_scale go together (Llama-4's floor_scale and attn_scale), "
           f"got temp_floor={tf!r}, temp_scale={ts!r}")
    expect(tf is None or (isinstance(tf, (int, float)) and not isinstance(tf, bool) and tf > 0),
           f"attention temp_floor must be a positive number (Llama-4's floor_scale), got {tf!r}")
    expect(ts is None or (isinstance(ts, (int, float)) and not isinstance(ts, bool)),
           f"attention temp_scale must be a number (Llama-4's attn_scale), got {ts!r}")


# -- references (float32 numpy, over the reference executor's paged caches) -------------------

def _fp8_scale(ctx, name):
    """This layer's scale of cache `name` when it holds e4m3 codes (--kv-cache-dtype fp8), else
    None (a ctx without declarations, e.g. a kernel test's, holds plain values)."""
    decl = getattr(ctx, "cache_decl", lambda n: None)(name)
    if decl is None or decl["dtype"] != cache_layout.FP8:
        return None
    return np.float32(cache_layout.scale(decl, ctx.layer))


def write_kv(ctx, k, v):
    """Paged write: row t of k / v goes to slot slot_mapping[t] (rows with a slot < 0 are padding).
    An FP8 cache stores the e4m3 code of x / scale (nearest even, saturated at +-448)."""
    slots = np.asarray(ctx.meta.slot_mapping[: k.shape[0]], np.int64)
    ok = slots >= 0
    for name, x in (("k", k), ("v", v)):
        cache = ctx.cache(name)
        ps = cache.shape[1]
        x = np.asarray(x, np.float32)[ok]
        s = _fp8_scale(ctx, name)
        cache[slots[ok] // ps, slots[ok] % ps] = x if s is None else round_e4m3(x / s)


def read_kv(ctx, b, n):
    """The first n cached keys and values of batch row b: [n, Hkv, D] each (an FP8 cache's codes
    times its scale)."""
    out = []
    for name in ("k", "v"):
        cache = ctx.cache(name)
        ps = cache.shape[1]
        pages = np.asarray(ctx.meta.block_tables[b, : -(-n // ps)], np.int64)
        x = np.asarray(cache[pages].reshape(-1, *cache.shape[2:])[:n], np.float32)
        s = _fp8_scale(ctx, name)
        out.append(x if s is None else x * s)
    return out


def attend_cached(ctx, q, scale=None, window=None, softcap=None, sinks=None, alibi=None, chunk=None,
                  temp_floor=None, temp_scale=None):
    """Causal GQA attention of q over each sequence's cache (float32); sinks [Hq]: each head's
    extra softmax logit that weighs no value; alibi, chunk, temp_*: the module docstring's."""
    T, hq, d = q.shape
    scale = scale if scale is not None else 1.0 / np.sqrt(d)
    slopes = None if alibi_max(alibi) is None else alibi_slopes(hq, alibi_max(alibi))
    out = np.zeros(q.shape, dtype=np.float32)
    for b, start, n, cached in ctx.seqs:
        L = cached + n
        K, V = read_kv(ctx, b, L)
        group = hq // K.shape[1]
        Kh = np.repeat(K, group, axis=1)           # [L, Hq, D]
        Vh = np.repeat(V, group, axis=1)
        qb = np.asarray(q[start:start + n], np.float32)
        if temp_floor is not None:
            # Llama-4's query scale: log(floor((p + 1) / F) + 1) * a + 1, pos_scale's shift-1 form
            qb = qb * pos_factor(cached + np.arange(n), temp_floor, temp_scale, shift=1)[:, None, None]
        s = np.einsum("ihd,jhd->hij", qb, Kh) * np.float32(scale)
        if softcap is not None:
            s = np.float32(softcap) * np.tanh(s / np.float32(softcap))
        qpos = cached + np.arange(n)[:, None]
        kpos = np.arange(L)[None, :]
        if slopes is not None:
            s = s + slopes[:, None, None] * (kpos - qpos)[None].astype(np.float32)
        hidden = kpos > qpos
        if window is not None:
            hidden |= qpos - kpos >= window
        if chunk is not None:
            hidden |= kpos // int(chunk) != qpos // int(chunk)
        s = np.where(hidden[None], -np.inf, s)
        m = s.max(-1, keepdims=True)
        if sinks is not None:
            sink = np.asarray(sinks, np.float32)[:, None, None]
            m = np.maximum(m, sink)
        p = np.exp(s - m)
        denom = p.sum(-1, keepdims=True)
        if sinks is not None:
            denom = denom + np.exp(sink - m)
        p /= denom
        out[start:start + n] = np.einsum("hij,jhd->ihd", p, Vh)
    return out


# -- attention (spec op) ------------------------------------------------------------------------

def _check_sinks(types, attrs, q):
    """The sinks input (one f32 logit per query head) when attrs has_sinks; types: the inputs after
    the required ones."""
    if attrs.get("has_sinks"):
        expect(len(types) == 1 and tuple(types[0].shape) == (q.shape[1],),
               f"attention sinks must be [{q.shape[1]}] (one per query head), got {types}")
    else:
        expect(not types, f"attention: {len(types)} inputs after the required ones without has_sinks")


def infer(types, attrs):
    q, k, v = types[:3]
    _check_sinks(types[3:], attrs, q)
    expect(len(q.shape) == 3 and len(k.shape) == 3 and k.shape == v.shape,
           f"attention expects q[T, Hq, D], k/v[T, Hkv, D]; got {q}, {k}, {v}")
    expect(q.shape[2] == k.shape[2], f"q head_dim {q.shape[2]} != k head_dim {k.shape[2]}")
    expect(q.shape[1] % k.shape[1] == 0, f"q heads {q.shape[1]} not a multiple of kv heads {k.shape[1]}")
    expect(attrs.get("causal", True), "only causal attention is implemented (causal=false given)")
    _check_attrs(attrs)
    return [q]


def reference(ctx, q, k, v, sinks=None, causal=True, scale=None, window=None, softcap=None, has_sinks=False,
              **extra):
    assert causal, "only causal attention is implemented"
    write_kv(ctx, k, v)
    return attend_cached(ctx, q, scale, window, softcap, sinks if has_sinks else None, **extra)


op(name="attention", tensors=["q", "k", "v"], extra_optional=["sinks"],
   attrs={"causal": True, "scale": None, "window": None, "softcap": None}, extra_attrs=EXTRA_ATTRS,
   infer=infer, reference=reference,
   caches=lambda types, attrs: _kv_caches(types[1].shape[1], types[1].shape[2]),
   templates={},   # no kernel of its own: split_attention lowers it to kv_write + attention_cached
   doc="causal GQA attention (optional scale, sliding window, logit softcap, sinks, ALiBi, chunks, "
       "query temperature) over the paged KV cache")


# -- kv_write(k[T, Hkv, D], v[T, Hkv, D]) -> cache marker ---------------------------------------

def kv_write_infer(types, attrs):
    k, v = types
    expect(len(k.shape) == 3 and k.shape == v.shape, f"kv_write expects k, v [T, Hkv, D]; got {k}, {v}")
    return [None]


op(name="kv_write", tensors=["k", "v"], internal=True, infer=kv_write_infer,
   reference=lambda ctx, k, v: write_kv(ctx, k, v),
   caches=lambda types, attrs: _kv_caches(types[0].shape[1], types[0].shape[2]),
   templates={"triton": "kv_write"}, strided=True,
   doc="write the step's k/v rows into the paged caches k, v at their slots")


# -- attention_cached(q[T, Hq, D], cache) -> [T, Hq, D] over the caches `cache` marks as written --

def attention_cached_infer(types, attrs):
    q = types[0]
    _check_sinks(types[2:], attrs, q)
    expect(len(q.shape) == 3, f"attention_cached expects q[T, Hq, D], got {q}")
    expect(isinstance(attrs.get("kv_heads"), int),
           "attention_cached needs attrs kv_heads (the k/v head count; the pass that makes it sets it)")
    expect(q.shape[1] % attrs["kv_heads"] == 0,
           f"q heads {q.shape[1]} not a multiple of kv heads {attrs['kv_heads']}")
    _check_attrs(attrs)
    return [q]


op(name="attention_cached", tensors=["q", "cache"], extra_optional=["sinks"], internal=True,
   attrs={"kv_heads": REQUIRED, "scale": None, "window": None, "softcap": None}, extra_attrs=EXTRA_ATTRS,
   triton_only_attrs=list(EXTRA_ATTRS),     # the TileLang decode implements none of them
   infer=attention_cached_infer,
   reference=lambda ctx, q, cache, sinks=None, kv_heads=None, scale=None, window=None, softcap=None,
       has_sinks=False, **extra: attend_cached(ctx, q, scale, window, softcap,
                                               sinks if has_sinks else None, **extra),
   caches=lambda types, attrs: _kv_caches(attrs["kv_heads"], types[0].shape[2]),
   # mixed and short: flash tiles for long chunks, split-KV for decode rows and short suffixes
   templates={"triton": {"prefill": "attention_prefill", "mixed": "attention_mixed",
                         "short": "attention_mixed", "decode": "attention_decode"},
              "tilelang": {"decode": "attention_decode"}},
   doc="causal GQA attention over the paged KV cache (scale, sliding window, logit softcap, sinks, ALiBi, "
       "chunks, query temperature)")
