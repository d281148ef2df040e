"""DeepSeek-V4 attention: compressed KV entries, the lightning indexer, and the attention over a
sliding window plus compressed entries. Semantics are transformers' modeling_deepseek_v4.py
(DeepseekV4Attention, its HCA / CSA compressors and DeepseekV4Indexer);
tests/test_deepseek_v4_attention.py checks each reference against those modules.

rope_tail(x[T, h, D], theta, scaling=None, rotary_dim=R, inverse=false) -> x with its LAST R dims
    rotated as interleaved pairs (x[D-R+2j], x[D-R+2j+1]) by its token's position (V4 lays a head
    out as [nope | rope]); inverse=true rotates by minus the angle (HF's apply_rotary_pos_emb with
    -sin, undoing the rotation the values carry on the attention output). inv_freq and the
    attention factor come from rope.rope_parameters(R, theta, scaling) (yarn included).

Compression (one helper, two ops): per sequence, the step's rows kv[t, W] and gate[t, W] (the
    compressor's kv_proj / gate_proj) go, with bias[p % m] added to the gate, into row
    p % (2m | m) of the sequence's slot cache `<cache>_buf` [2m | m, 2W] (kv | gate, f32): the
    partial block of the last < m tokens, and for overlap the block before it. When a position p
    with p % m == m - 1 completes block e = p // m, its entry is
      non-overlap (W = Dc, HCA):  sum_j softmax_j(gate_j) kv_j           over the block's m rows
      overlap (W = 2 Dc, CSA):    the same over 2m rows: block e - 1's first halves [:Dc] (absent,
                                  i.e. weight 0, for e = 0) and block e's second halves [Dc:]
    (softmax per channel, f32), then RMSNorm(norm, eps), then rope_tail at position e m; it is
    written to entry e of the compressed paged cache `<cache>` (every = m,
    compiler/contract/caches.py's entry_address). The slot is read only for a sequence with
    tokens cached, so a new sequence starts from nothing.

indexer_topk(q[T, Hi, Di], w[T, Hi], kv[T, 2Di], gate[T, 2Di], bias[m, 2Di], norm[Di], rate=m,
             topk, eps, theta, scaling, rotary_dim, cache="ikv") -> [T, topk] i32
    compresses its keys (overlap, cache `<cache>`), then for query at position p over the entries
    e < (p + 1) // m (the blocks complete at p):
      score_e = sum_h (w[h] / sqrt(Hi)) * relu(q[h] . K_e) / sqrt(Di)
    and returns the indices of the min(topk, visible) best (ties: the lower index), the rest -1.

compressed_attention(q[T, H, D], kv[T, D], sinks[H], ckv[T, W], cgate[T, W], cbias[m, W],
                     cnorm[D], index[T, K] i32 optional, rate=m, window, scale, eps, theta,
                     scaling, rotary_dim, cache) -> [T, H, D]
    writes the step's kv rows (shared-KV MQA: one head, keys = values) to paged cache `swa`,
    compresses (overlap iff W = 2D) into `<cache>`, then query i at position p attends, as one
    softmax with the head's sink logit (weighing no value), over
      the window keys j with p - window < j <= p (scores q . kv_j * scale), and
      the compressed entries: with index, those of index[i] >= 0; without, every e < (p + 1) // m.

Both spec ops lower (compiler/passes/split_compression.py) to a writer and a reader, so that no
kernel has to compress a sequence's rows before its own queries read them:
    compress_write(kv, gate, bias, norm, rows optional, rate, cache, ...) -> cache marker
        the entries above into `<cache>`, each block's rows from the step or, for rows of earlier
        steps, from `<cache>_buf` (and, with rows, the window's rows into `swa`);
    compress_carry(kv, gate, bias, marker, rate, cache, overlap) -> cache marker
        the step's rows into `<cache>_buf` (after compress_write: they overwrite what it reads);
    indexer_topk_cached(q, w, marker, rate, topk, cache) -> [T, topk] i32
    compressed_attention_cached(q, marker, sinks, index optional, rate, window, scale, cache)
        the scoring / attention above over the caches the writer filled; each a program a token row.
"""
import numpy as np

from ..contract import caches as cache_layout
from .base import REQUIRED, expect, op, tt
from .rope import CHECK_DIM, check_parameters, rope_parameters
from .latent_attention import read_rows, write_rows


# -- rope on the trailing dims -----------------------------------------------------------------

def rotate_tail(x, positions, theta, scaling, rotary_dim, inverse=False):
    """x[N, h, D] with its last rotary_dim dims rotated (interleaved pairs) at positions[N]."""
    x = np.asarray(x, np.float32)
    r = int(rotary_dim)
    freq, attention = rope_parameters(r, theta, _own(scaling))
    ang = np.asarray(positions).astype(np.float32)[:, None] * freq[None, :]
    cos = (np.cos(ang) * np.float32(attention))[:, None, :]
    sin = (np.sin(ang) * np.float32(attention))[:, None, :]
    if inverse:
        sin = -sin
    d = x.shape[-1]
    x1, x2 = x[..., d - r::2], x[..., d - r + 1::2]
    pairs = np.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return np.concatenate([x[..., :d - r], pairs.reshape(*x.shape[:-1], r)], axis=-1)


def _own(scaling):
    """The rope parameters without partial_rotary_factor (rotary_dim says it; the indexer's head
    is not the attention's)."""
    if not scaling:
        return None
    return {k: v for k, v in scaling.items() if k != "partial_rotary_factor"}


def _check_rope(head_dim, attrs):
    r = attrs.get("rotary_dim")
    expect(isinstance(r, int) and 0 < r <= head_dim and r % 2 == 0,
           f"rotary_dim must be an even int in 1..{head_dim}, got {r!r}")
    try:        # as rope.check: the parameters by name, the values at a bounded dim
        check_parameters(attrs["theta"], _own(attrs.get("scaling")))
        rope_parameters(min(r, CHECK_DIM), attrs["theta"], _own(attrs.get("scaling")))
    except ValueError as e:
        expect(False, str(e))


def rope_tail_infer(types, attrs):
    (x,) = types
    expect(len(x.shape) == 3, f"rope_tail expects x[T, heads, D], got {x}")
    _check_rope(x.shape[2], attrs)
    return [x]


op(name="rope_tail", tensors=["x"],
   attrs={"theta": REQUIRED, "scaling": None, "rotary_dim": REQUIRED, "inverse": False},
   infer=rope_tail_infer,
   reference=lambda ctx, x, theta, scaling=None, rotary_dim=None, inverse=False:
       rotate_tail(x, ctx.positions, theta, scaling, rotary_dim, inverse),
   templates={"triton": "rope_tail"}, strided=True,
   doc="interleaved RoPE of the last rotary_dim dims of each head (DeepSeek-V4); inverse: by -angle")


# -- compression ---------------------------------------------------------------------------------

def _entries_decl(name, rate, dc):
    """The compressed entries: paged, one a `rate` tokens."""
    return {name: {"kind": "paged", "every": int(rate), "shape": [int(dc)], "dtype": "bf16"}}


def _partial_decl(name, rate, width, overlap):
    """The partial blocks (slot): the last block's rows, and with overlap the block before too."""
    rows = 2 * int(rate) if overlap else int(rate)
    return {f"{name}_buf": {"kind": "slot", "shape": [rows, 2 * int(width)], "dtype": "f32"}}


def _compressed_caches(name, rate, width, dc):
    """The compressed entries and the partial blocks (overlap: the gates are 2 Dc wide)."""
    return {**_entries_decl(name, rate, dc), **_partial_decl(name, rate, width, width == 2 * dc)}


def _rms(x, w, eps):
    x = np.asarray(x, np.float32)
    return np.asarray(w, np.float32) * (x / np.sqrt(np.mean(x * x, -1, keepdims=True) + np.float32(eps)))


def compress(ctx, kv, gate, bias, norm, cache, rate, eps, theta, scaling, rotary_dim, carry=True):
    """Writes every entry the step's rows complete (the module docstring) and, with carry, buffers
    the rows in the slot (carry_rows: compress_carry's half, a launch after the entries')."""
    kv, gate = np.asarray(kv, np.float32), np.asarray(gate, np.float32)
    bias = np.asarray(bias, np.float32)
    m, width, dc = int(rate), kv.shape[1], np.asarray(norm).shape[0]
    overlap = width == 2 * dc
    buf = ctx.cache(f"{cache}_buf")                     # [num_slots + 1, rows, 2W]
    entries = ctx.cache(cache)                          # [num_pages + 1, rows a page, Dc]
    decl, rows = {"every": m}, buf.shape[1]
    for b, slot, state, p, last in _slot_rows(ctx, buf, kv, gate, bias, m):
        if carry and last:
            buf[slot] = state
        if p % m == m - 1:
            e = p // m
            cur = state[[(e * m + j) % rows for j in range(m)]]
            if overlap:
                vals, logits = cur[:, dc:width], cur[:, width + dc:]
                if e > 0:
                    prev = state[[((e - 1) * m + j) % rows for j in range(m)]]
                    vals = np.concatenate([prev[:, :dc], vals])
                    logits = np.concatenate([prev[:, width:width + dc], logits])
            else:
                vals, logits = cur[:, :width], cur[:, width:]
            w = np.exp(logits - logits.max(0, keepdims=True))
            entry = _rms((w / w.sum(0, keepdims=True) * vals).sum(0), norm, eps)
            entry = rotate_tail(entry[None, None], [e * m], theta, scaling, rotary_dim)[0, 0]
            page, row = cache_layout.entry_address(decl, ctx.page_size, ctx.meta.block_tables[b], e)
            entries[int(page), int(row)] = entry
    return entries


def _slot_rows(ctx, buf, kv, gate, bias, m):
    """Each row of the step, in order, put into row p % rows of a copy of its sequence's slot
    (kv, gate + bias[p % m]): yields (b, slot, the copy, p, whether the sequence's last row)."""
    rows = buf.shape[1]
    for b, start, n, cached in ctx.seqs:
        slot = int(ctx.meta.state_slots[b])
        state = np.array(buf[slot], np.float32) if cached > 0 else np.zeros(buf.shape[1:], np.float32)
        for i in range(n):
            p = cached + i
            state[p % rows] = np.concatenate([kv[start + i], gate[start + i] + bias[p % m]])
            yield b, slot, state, p, i == n - 1


def carry_rows(ctx, kv, gate, bias, cache, rate):
    """The step's rows (kv, gate + bias[p % m]) into row p % rows of their sequence's slot."""
    kv, gate, bias = (np.asarray(a, np.float32) for a in (kv, gate, bias))
    buf = ctx.cache(f"{cache}_buf")
    for _, slot, state, _, last in _slot_rows(ctx, buf, kv, gate, bias, int(rate)):
        if last:
            buf[slot] = state


def read_entries(ctx, cache, b, count, rate):
    """The first `count` compressed entries of batch row b: [count, Dc]."""
    entries = ctx.cache(cache)
    pages, rows = cache_layout.entry_address({"every": int(rate)}, ctx.page_size, ctx.meta.block_tables[b],
                                             np.arange(count))
    return np.asarray(entries[pages, rows], np.float32).reshape(count, entries.shape[-1])


def _check_compressor(kv, gate, bias, norm, attrs, what):
    m = attrs.get("rate")
    expect(isinstance(m, int) and m >= 1, f"{what} rate must be a positive int, got {m!r}")
    expect(len(kv.shape) == 2 and kv.shape == gate.shape,
           f"{what}: compressor kv and gate must be [T, W] alike, got {kv}, {gate}")
    expect(len(norm.shape) == 1 and kv.shape[1] in (norm.shape[0], 2 * norm.shape[0]),
           f"{what}: compressor width {kv.shape[1]} must be Dc or 2 Dc (overlap), Dc = {norm.shape}")
    expect(tuple(bias.shape) == (m, kv.shape[1]),
           f"{what}: compressor bias must be [rate, W] = [{m}, {kv.shape[1]}], got {bias}")
    expect(isinstance(attrs.get("cache"), str) and attrs["cache"].isidentifier(),
           f"{what}: cache must name the compressed cache, got {attrs.get('cache')!r}")


# -- indexer_topk -------------------------------------------------------------------------------

def indexer_infer(types, attrs):
    q, w, kv, gate, bias, norm = types
    expect(len(q.shape) == 3 and tuple(w.shape) == tuple(q.shape[:2]),
           f"indexer_topk expects q[T, Hi, Di] and w[T, Hi], got {q}, {w}")
    _check_compressor(kv, gate, bias, norm, attrs, "indexer_topk")
    expect(kv.shape[1] == 2 * q.shape[2] and norm.shape[0] == q.shape[2],
           f"indexer_topk: keys of {norm.shape[0]} (overlapping, width {kv.shape[1]}) for queries of {q.shape[2]}")
    k = attrs.get("topk")
    expect(isinstance(k, int) and k >= 1, f"indexer_topk topk must be a positive int, got {k!r}")
    _check_rope(q.shape[2], attrs)
    return [tt((q.shape[0], k), "i32")]


def indexer_reference(ctx, q, w, kv, gate, bias, norm, rate, topk, cache="ikv", eps=1e-6, theta=None,
                      scaling=None, rotary_dim=None):
    compress(ctx, kv, gate, bias, norm, cache, rate, eps, theta, scaling, rotary_dim)
    return score_topk(ctx, q, w, cache, rate, topk)


def score_topk(ctx, q, w, cache, rate, topk):
    """Each query's top-k of the compressed keys in cache `cache` (the op's docstring)."""
    q, w = np.asarray(q, np.float32), np.asarray(w, np.float32)
    hi, di = q.shape[1:]
    out = np.full((q.shape[0], topk), -1, np.int32)
    for b, start, n, cached in ctx.seqs:
        keys = read_entries(ctx, cache, b, (cached + n) // rate, rate)
        for i in range(n):
            p, t = cached + i, start + i
            vis = (p + 1) // rate
            if vis == 0:
                continue
            s = np.maximum(q[t] @ keys[:vis].T, 0) * np.float32(di ** -0.5)       # [Hi, vis]
            score = (s * (w[t] * np.float32(hi ** -0.5))[:, None]).sum(0)
            best = np.argsort(-score, kind="stable")[:topk]
            out[t, :len(best)] = best
    return out


op(name="indexer_topk", tensors=["q", "w", "kv", "gate", "bias", "norm"],
   attrs={"rate": REQUIRED, "topk": REQUIRED, "cache": "ikv", "eps": 1e-6, "theta": REQUIRED,
          "scaling": None, "rotary_dim": REQUIRED},
   infer=indexer_infer, reference=indexer_reference,
   caches=lambda types, attrs: _compressed_caches(attrs["cache"], attrs["rate"], types[2].shape[1],
                                                  types[5].shape[0]),
   templates={},   # no kernel of its own: split_compression lowers it to compress_write + indexer_topk_cached
   doc="DeepSeek-V4 lightning indexer: compresses its keys (cache <cache>), returns each query's "
       "top-k visible compressed entries (-1 past the visible ones)")


# -- compressed_attention -----------------------------------------------------------------------

def attention_infer(types, attrs):
    q, kv, sinks, ckv, cgate, cbias, cnorm = types[:7]
    expect(len(q.shape) == 3 and len(kv.shape) == 2 and kv.shape[1] == q.shape[2],
           f"compressed_attention expects q[T, H, D], kv[T, D]; got {q}, {kv}")
    expect(tuple(sinks.shape) == (q.shape[1],), f"compressed_attention sinks must be [{q.shape[1]}], got {sinks}")
    _check_compressor(ckv, cgate, cbias, cnorm, attrs, "compressed_attention")
    expect(cnorm.shape[0] == q.shape[2], f"compressed_attention: entries of {cnorm.shape[0]} for heads of {q.shape[2]}")
    if attrs.get("has_index"):
        expect(len(types) == 8 and len(types[7].shape) == 2 and types[7].dtype == "i32",
               f"compressed_attention index must be [T, K] i32, got {types[7:]}")
    w = attrs.get("window")
    expect(isinstance(w, int) and w >= 1, f"compressed_attention window must be a positive int, got {w!r}")
    s = attrs.get("scale")
    expect(s is None or s > 0, f"compressed_attention scale must be positive, got {s}")
    _check_rope(q.shape[2], attrs)
    return [q]



def attention_reference(ctx, q, kv, sinks, ckv, cgate, cbias, cnorm, index=None, rate=None, window=None,
                        scale=None, cache=None, eps=1e-6, theta=None, scaling=None, rotary_dim=None,
                        has_index=False):
    write_rows(ctx, "swa", kv)
    compress(ctx, ckv, cgate, cbias, cnorm, cache, rate, eps, theta, scaling, rotary_dim)
    return attend_compressed(ctx, q, sinks, index if has_index else None, rate, window, scale, cache)


def attend_compressed(ctx, q, sinks, index, rate, window, scale, cache):
    """Each query over its window (cache swa) and its compressed entries (cache `cache`): the chosen
    ones where index is given, else every visible one (the op's docstring)."""
    q = np.asarray(q, np.float32)
    T, h, d = q.shape
    scale = np.float32(scale if scale is not None else d ** -0.5)
    sinks = np.asarray(sinks, np.float32)
    out = np.zeros(q.shape, np.float32)
    for b, start, n, cached in ctx.seqs:
        L = cached + n
        keys = read_rows(ctx, "swa", b, L)
        entries = read_entries(ctx, cache, b, L // rate, rate)
        for i in range(n):
            p, t = cached + i, start + i
            lo = max(0, p - window + 1)
            chosen = (index[t][index[t] >= 0] if index is not None else np.arange((p + 1) // rate))
            vals = np.concatenate([keys[lo:p + 1], entries[np.asarray(chosen, np.int64)]])
            s = (q[t] @ vals.T) * scale                                     # [H, n keys]
            mx = np.maximum(s.max(-1), sinks)
            e = np.exp(s - mx[:, None])
            out[t] = (e @ vals) / (e.sum(-1) + np.exp(sinks - mx))[:, None]
    return out


def _attention_caches(types, attrs):
    out = {"swa": {"kind": "paged", "shape": [int(types[1].shape[1])], "dtype": "bf16"}}
    out.update(_compressed_caches(attrs["cache"], attrs["rate"], types[3].shape[1], types[6].shape[0]))
    return out


op(name="compressed_attention", tensors=["q", "kv", "sinks", "ckv", "cgate", "cbias", "cnorm"],
   optional=["index"],
   attrs={"rate": REQUIRED, "window": REQUIRED, "scale": None, "cache": REQUIRED, "eps": 1e-6,
          "theta": REQUIRED, "scaling": None, "rotary_dim": REQUIRED},
   infer=attention_infer, reference=attention_reference, caches=_attention_caches,
   # no kernel of its own: split_compression lowers it to compress_write + compressed_attention_cached
   templates={},
   doc="DeepSeek-V4 attention: shared-KV MQA over a sliding window (cache swa) and the compressed "
       "entries (cache <cache>; all visible, or the indexer's top-k), with per-head sinks")


# -- the lowered forms (compiler/passes/split_compression.py) -----------------------------------
# The compression writes the caches every later query reads, so it runs in a launch of its own
# (a program a sequence: its rows go through the slot's blocks in order) and the two readers run
# a program a query token; the cache marker orders them, as kv_write orders attention_cached.

def compress_write_infer(types, attrs):
    kv, gate, bias, norm = types[:4]
    _check_compressor(kv, gate, bias, norm, attrs, "compress_write")
    if attrs.get("has_rows"):
        rows = types[4]
        expect(len(rows.shape) == 2 and rows.shape[1] == norm.shape[0],
               f"compress_write: window rows must be [T, {norm.shape[0]}], got {rows}")
    _check_rope(norm.shape[0], attrs)
    return [None]


def compress_write_reference(ctx, kv, gate, bias, norm, rows=None, rate=None, cache=None, eps=1e-6,
                             theta=None, scaling=None, rotary_dim=None, has_rows=False):
    if has_rows:
        write_rows(ctx, "swa", rows)
    compress(ctx, kv, gate, bias, norm, cache, rate, eps, theta, scaling, rotary_dim, carry=False)


def _compress_write_caches(types, attrs):
    out = _compressed_caches(attrs["cache"], attrs["rate"], types[0].shape[1], types[3].shape[0])
    if attrs.get("has_rows"):
        out["swa"] = {"kind": "paged", "shape": [int(types[4].shape[1])], "dtype": "bf16"}
    return out


op(name="compress_write", tensors=["kv", "gate", "bias", "norm"], optional=["rows"], internal=True,
   attrs={"rate": REQUIRED, "cache": REQUIRED, "eps": 1e-6, "theta": REQUIRED, "scaling": None,
          "rotary_dim": REQUIRED},
   infer=compress_write_infer, reference=compress_write_reference, caches=_compress_write_caches,
   templates={"triton": "compress_write"},
   doc="DeepSeek-V4's compressor: each block the step's rows complete (its rows from the step or "
       "from the partial blocks <cache>_buf) into <cache>; with rows, the window's rows into swa")


def compress_carry_infer(types, attrs):
    kv, gate, bias = types[:3]
    expect(len(kv.shape) == 2 and kv.shape == gate.shape and tuple(bias.shape) == (attrs["rate"], kv.shape[1]),
           f"compress_carry expects kv, gate [T, W] and bias [rate, W], got {kv}, {gate}, {bias}")
    return [None]


def _carry_caches(types, attrs):
    """The partial blocks' slot, as compress_write declares it."""
    return _partial_decl(attrs["cache"], attrs["rate"], types[0].shape[1], attrs.get("overlap"))


# after compress_write, which reads the slot's rows of earlier steps: the step's rows overwrite
# them (row p % rows), so they go in once every entry is written, a launch of their own
op(name="compress_carry", tensors=["kv", "gate", "bias", "cache"], internal=True,
   attrs={"rate": REQUIRED, "cache": REQUIRED, "overlap": REQUIRED},
   infer=compress_carry_infer,
   reference=lambda ctx, kv, gate, bias, marker, rate=None, cache=None, overlap=None:
       carry_rows(ctx, kv, gate, bias, cache, rate),
   caches=_carry_caches, templates={"triton": "compress_carry"},
   doc="DeepSeek-V4's compressor: the step's rows into the partial blocks (<cache>_buf)")


def _entries_cache(attrs, width):
    """The paged compressed entries a reader reads (its writer declares the partial blocks)."""
    return _entries_decl(attrs["cache"], attrs["rate"], width)


def indexer_cached_infer(types, attrs):
    q, w = types[:2]
    expect(len(q.shape) == 3 and tuple(w.shape) == tuple(q.shape[:2]),
           f"indexer_topk_cached expects q[T, Hi, Di] and w[T, Hi], got {q}, {w}")
    k = attrs.get("topk")
    expect(isinstance(k, int) and k >= 1, f"indexer_topk_cached topk must be a positive int, got {k!r}")
    return [tt((q.shape[0], k), "i32")]


op(name="indexer_topk_cached", tensors=["q", "w", "cache"], internal=True,
   attrs={"rate": REQUIRED, "topk": REQUIRED, "cache": REQUIRED},
   infer=indexer_cached_infer,
   reference=lambda ctx, q, w, marker, rate=None, topk=None, cache=None: score_topk(ctx, q, w, cache, rate, topk),
   caches=lambda types, attrs: _entries_cache(attrs, types[0].shape[2]),
   templates={"triton": "indexer_topk"},
   doc="DeepSeek-V4's indexer over the keys compress_write wrote: each query's top-k")


def attention_cached_infer(types, attrs):
    q, _, sinks = types[:3]
    expect(len(q.shape) == 3 and tuple(sinks.shape) == (q.shape[1],),
           f"compressed_attention_cached expects q[T, H, D] and sinks[H], got {q}, {sinks}")
    if attrs.get("has_index"):
        expect(len(types) == 4 and len(types[3].shape) == 2 and types[3].dtype == "i32",
               f"compressed_attention_cached index must be [T, K] i32, got {types[3:]}")
    return [q]


def _attention_cached_caches(types, attrs):
    d = types[0].shape[2]
    return {"swa": {"kind": "paged", "shape": [int(d)], "dtype": "bf16"}, **_entries_cache(attrs, d)}


op(name="compressed_attention_cached", tensors=["q", "cache", "sinks"], optional=["index"], internal=True,
   attrs={"rate": REQUIRED, "window": REQUIRED, "scale": None, "cache": REQUIRED},
   infer=attention_cached_infer,
   reference=lambda ctx, q, marker, sinks, index=None, rate=None, window=None, scale=None, cache=None,
       has_index=False: attend_compressed(ctx, q, sinks, index if has_index else None, rate, window, scale, cache),
   caches=_attention_cached_caches,
   templates={"triton": "compressed_attention"},
   doc="DeepSeek-V4 attention over the window and compressed caches compress_write wrote")
