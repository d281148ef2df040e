# latent_attention_decode: absorbed MLA, one new token per sequence: q [B, H=16, Dc + Dr=576],
# kv [B, 576] its latent row (Dc=512, Dr=64), o [B, H, Dc]. With L = context_lens[b]:
#   latent row L - 1 is kv[b] (written to slot_mapping[b] by split 0; no program of this launch
#   reads it from the cache), rows j < L - 1 are Lat[j] = latent[block_tables[b, j // 16], j % 16]
#   s_j = q[b, h] . Lat[j] * scale (scale = 0.1147213867929261),  o[b, h] = sum_{j < L} softmax_j(s) Lat[j, :Dc]
# All H heads share the one latent "kv head" (MQA, G = H): a program's rows are the H heads (padded
# to H_PAD=16 for tl.dot), so each latent row is read once per split. Scores are q_c . Lat_c +
# q_r . Lat_r over the Dc and Dr parts (each padded to a power of two).
# Grid (B, ns), ns = min(NUM_SPLITS=32, max(1, cdiv(TARGET_CTAS=264, B))). Split s owns keys
# [s * kps, (s + 1) * kps), kps = ceil(ceil(L / ns) / BLOCK_N) * BLOCK_N; only the n = cdiv(L, kps)
# non-empty splits run. Online softmax per split; n <= 1 writes o = acc / l, otherwise partials
# (acc, m, l) go to scratch and the split that arrives last merges them (attention_decode's protocol:
# a CTA barrier, one acq_rel atomic on the sequence's counter, .cg loads, counter back to 0).
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def latent_attention_decode(q_ptr, kv_ptr, cache, o_ptr, slot_mapping, block_tables, context_lens,
                            max_pages, B, part_o, part_ml, counter,
                            H: tl.constexpr, H_PAD: tl.constexpr, H_M: tl.constexpr,
                            D: tl.constexpr, DC: tl.constexpr, DR: tl.constexpr,
                            BLOCK_DC: tl.constexpr, BLOCK_DR: tl.constexpr,
                            PS: tl.constexpr, BLOCK_N: tl.constexpr, MERGE_CHUNK: tl.constexpr,
                            QK_SCALE: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
    if PDL:
        gdc_wait()   # earlier kernels' writes are visible from here on
    b = tl.program_id(0)
    s = tl.program_id(1)
    ns = tl.num_programs(1)
    L = tl.load(context_lens + b)
    dc = tl.arange(0, BLOCK_DC)
    dr = tl.arange(0, BLOCK_DR)
    dcm = dc < DC
    drm = dr < DR
    kv_row = kv_ptr + b.to(tl.int64) * D
    if s == 0:
        slot = tl.load(slot_mapping + b).to(tl.int64)
        if slot >= 0:
            tl.store(cache + slot * D + dc, tl.load(kv_row + dc, mask=dcm).to(cache.dtype.element_ty), mask=dcm)
            tl.store(cache + slot * D + DC + dr, tl.load(kv_row + DC + dr, mask=drm).to(cache.dtype.element_ty),
                     mask=drm)
    kps = tl.maximum(tl.cdiv(tl.cdiv(L, ns), BLOCK_N) * BLOCK_N, BLOCK_N)
    n_act = tl.cdiv(L, kps)
    if s >= tl.maximum(n_act, 1):
        return

    g = tl.arange(0, H_PAD)
    gm = g < H
    q_rows = (b.to(tl.int64) * H + g) * D
    q_c = tl.load(q_ptr + q_rows[:, None] + dc[None, :], mask=gm[:, None] & dcm[None, :], other=0.0)
    q_r = tl.load(q_ptr + q_rows[:, None] + DC + dr[None, :], mask=gm[:, None] & drm[None, :], other=0.0)
    if DOT_F32:
        q_c = q_c.to(tl.float32)
        q_r = q_r.to(tl.float32)

    # the new row (key L - 1) comes from kv, not the cache: it is merged into the tile that holds it
    new_c = tl.load(kv_row + dc, mask=dcm, other=0.0)
    new_r = tl.load(kv_row + DC + dr, mask=drm, other=0.0)
    start = s * kps
    end = tl.minimum(start + kps, L)
    bt = block_tables + b.to(tl.int64) * max_pages
    m_i = tl.full([H_PAD], -1.0e30, tl.float32)
    l_i = tl.zeros([H_PAD], tl.float32)
    acc = tl.zeros([H_PAD, BLOCK_DC], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        jj = n0 + tl.arange(0, BLOCK_N)
        jm = jj < end
        old = jm & (jj < L - 1)                   # from the cache
        new = jm & (jj == L - 1)                  # this step's row, from kv
        page = tl.load(bt + jj // PS, mask=old, other=0).to(tl.int64)
        rows = (page * PS + jj % PS) * D
        lc = tl.load(cache + rows[:, None] + dc[None, :], mask=old[:, None] & dcm[None, :], other=0.0)
        lr = tl.load(cache + rows[:, None] + DC + dr[None, :], mask=old[:, None] & drm[None, :], other=0.0)
        lc = tl.where(new[:, None], new_c.to(lc.dtype)[None, :], lc)
        lr = tl.where(new[:, None], new_r.to(lr.dtype)[None, :], lr)
        if DOT_F32:
            lc = lc.to(tl.float32)
            lr = lr.to(tl.float32)
        sc = (tl.dot(q_c, tl.trans(lc)) + tl.dot(q_r, tl.trans(lr))) * QK_SCALE   # [H_PAD, BLOCK_N], log2 units
        sc = tl.where(jm[None, :], sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(sc - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(lc.dtype), lc)
        m_i = m_new

    o_rows = ((b.to(tl.int64) * H + g) * DC)[:, None] + dc[None, :]
    out_m = gm[:, None] & dcm[None, :]
    if n_act <= 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(o_ptr + o_rows, out.to(o_ptr.dtype.element_ty), mask=out_m)
    else:
        # scratch: part_o [B * ns, H, Dc] f32, part_ml [B * ns, 2, H] f32 (row b * ns + s), counter [B]
        po = part_o.to(tl.pointer_type(tl.float32), bitcast=True)
        pml = part_ml.to(tl.pointer_type(tl.float32), bitcast=True)
        bb = b.to(tl.int64)
        po_rows = (((bb * ns + s) * H + g) * DC)[:, None] + dc[None, :]
        tl.store(po + po_rows, acc, mask=out_m)
        ml = pml + (bb * ns + s) * (2 * H) + g
        tl.store(ml, m_i, mask=gm)
        tl.store(ml + H, l_i, mask=gm)
        tl.debug_barrier()
        done = tl.atomic_add(counter + bb, 1, sem="acq_rel", scope="gpu")
        if done == n_act - 1:
            gg = tl.arange(0, H_M)
            ggm = gg < H
            m_t = tl.full([H_M], -1.0e30, tl.float32)
            l_t = tl.zeros([H_M], tl.float32)
            acc_t = tl.zeros([H_M, BLOCK_DC], tl.float32)
            for c0 in range(0, n_act, MERGE_CHUNK):
                sp = c0 + tl.arange(0, MERGE_CHUNK)
                base = bb * ns + sp
                mk = (sp < n_act)[:, None] & ggm[None, :]
                ml_off = (base * (2 * H))[:, None] + gg[None, :]
                m_s = tl.load(pml + ml_off, mask=mk, other=-1.0e30, cache_modifier=".cg")
                l_s = tl.load(pml + ml_off + H, mask=mk, other=0.0, cache_modifier=".cg")
                o_off = (((base * H)[:, None] + gg[None, :]) * DC)[:, :, None] + dc[None, None, :]
                o_s = tl.load(po + o_off, mask=mk[:, :, None] & dcm[None, None, :], other=0.0,
                              cache_modifier=".cg")
                m_new = tl.maximum(m_t, tl.max(m_s, 0))
                alpha = tl.exp2(m_t - m_new)
                w = tl.exp2(m_s - m_new[None, :])
                l_t = l_t * alpha + tl.sum(l_s * w, 0)
                acc_t = acc_t * alpha[:, None] + tl.sum(o_s * w[:, :, None], 0)
                m_t = m_new
            merged = acc_t / tl.where(l_t > 0, l_t, 1.0)[:, None]
            out_rows = ((bb * H + gg) * DC)[:, None] + dc[None, :]
            tl.store(o_ptr + out_rows, merged.to(o_ptr.dtype.element_ty), mask=ggm[:, None] & dcm[None, :])
            tl.atomic_xchg(counter + bb, 0, sem="relaxed", scope="gpu")

META = {
    "entry": "latent_attention_decode",
    "params": [
        ["q_ptr", "*bf16", "in:0"],
        ["kv_ptr", "*bf16", "in:1"],
        ["cache", "*bf16", "cache:latent"],
        ["o_ptr", "*bf16", "out:0"],
        ["slot_mapping", "*i32", "meta:slot_mapping"],
        ["block_tables", "*i32", "meta:block_tables"],
        ["context_lens", "*i32", "meta:context_lens"],
        ["max_pages", "i32", "meta:max_pages"],
        ["B", "i32", "dim:B"],
        ["part_o", "*fp32", "scratch:partial_o"],
        ["part_ml", "*fp32", "scratch:partial_ml"],
        ["counter", "*i32", "scratch:counter"],
    ],
    "constexprs": {"H": 16, "H_PAD": 16, "H_M": 16, "D": 576, "DC": 512,
                   "DR": 64, "BLOCK_DC": 512, "BLOCK_DR": 64,
                   "PS": 16, "BLOCK_N": 32, "MERGE_CHUNK": 4,
                   "QK_SCALE": 0.1655079758100591, "DOT_F32": False, "PDL": True},
    "pdl": True,
    "grid": ["B", "min(32, max(1, cdiv(264, B)))", 1],
    "num_warps": 8,
    "num_stages": 2,
    "scratch": {"partial_o": "(B + 264) * 32768",
                "partial_ml": "(B + 264) * 128",
                "counter": "B * 4"},
}
