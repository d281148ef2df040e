# attention_decode: one new token per sequence (row b of q [B, Hq=64, D=128]), causal over its
# whole paged cache (context_lens[b] = L keys, the new token's included), GQA group G=8:
#   s_j = q[b, h] . K[b, j, h // G] * scale
#   o[b, h] = sum_j softmax_j(s) V[b, j, h // G],  L - WINDOW <= j < L (window = 128: the query at L - 1 sees keys with L - 1 - j < window)
# with K[b, j] = k_cache[block_tables[b, j // 16], j % 16] and scale = 0.08838834764831845.
# Grid (B * Hkv, ns): one program per (sequence, kv head, split) covers the G query heads of its kv
# head (padded to G_PAD=16 rows for tl.dot) so K/V are read once. ns = min(NUM_SPLITS=32,
# max(1, cdiv(TARGET_CTAS=264, B * Hkv))) splits only as far as needed to fill the GPU.
# Only the window's pages are visited: keys from lo0 = floor(max(L - WINDOW, 0) / BLOCK_N) * BLOCK_N;
# split s owns keys lo0 + [s * kps, (s + 1) * kps), kps = ceil(ceil((L - lo0) / ns) / BLOCK_N) * BLOCK_N
# (whole pages); only the n = cdiv(L - lo0, kps) non-empty splits run; keys below L - WINDOW are masked.
# Each split keeps an online softmax
# (m = running max of the log2-scaled scores, l = sum of exp2(s - m), acc = sum exp2(s - m) v).
# n <= 1: the split writes o = acc / l (a context_lens[b] == 0 padding row gets zeros).
# Otherwise it writes (acc, m, l) to scratch, then bumps the (b, kv head) counter; the split that
# arrives last merges in the same launch:
#   M = max_s m_s, o = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s
# (MERGE_CHUNK=8 splits at a time) and sets the counter back to 0 (scratch is reusable
# across launches and graph replays). Memory order: a CTA barrier, then one thread's acq_rel
# atomic (release of all the CTA's partial stores, acquire of the others'); the merge reads
# partials with .cg (L2), never from a stale L1.
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def attention_decode(q_ptr, k_cache, v_cache, o_ptr, block_tables, context_lens, max_pages, B,
                     part_o, part_ml, counter,
                     HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
                     D: tl.constexpr, BLOCK_D: tl.constexpr, PS: tl.constexpr, BLOCK_N: tl.constexpr,
                     G_M: tl.constexpr, MERGE_CHUNK: tl.constexpr,
                     QK_SCALE: tl.constexpr,
                     WINDOW: tl.constexpr,
                     DOT_F32: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
    if PDL:
        gdc_wait()   # earlier kernels' writes are visible from here on
    pid = tl.program_id(0)
    b = pid // HKV
    kvh = pid % HKV
    s = tl.program_id(1)
    ns = tl.num_programs(1)
    L = tl.load(context_lens + b)
    lo = tl.maximum(L - WINDOW, 0)                                 # the window's first key
    lo0 = (lo // BLOCK_N) * BLOCK_N
    kps = tl.maximum(tl.cdiv(tl.cdiv(L - lo0, ns), BLOCK_N) * BLOCK_N, BLOCK_N)
    n_act = tl.cdiv(L - lo0, kps)
    if s >= tl.maximum(n_act, 1):
        return

    g = tl.arange(0, G_PAD)
    d = tl.arange(0, BLOCK_D)
    gm = g < G
    dm = d < D
    o_rows = (b.to(tl.int64) * HQ + kvh * G + g)[:, None] * D + d[None, :]
    q = tl.load(q_ptr + o_rows, mask=gm[:, None] & dm[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)

    start = lo0 + s * kps
    end = tl.minimum(start + kps, L)
    bt = block_tables + b.to(tl.int64) * max_pages
    m_i = tl.full([G_PAD], -1.0e30, tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        jj = n0 + tl.arange(0, BLOCK_N)
        jm = (jj < end) & (jj >= lo)
        page = tl.load(bt + jj // PS, mask=jm, other=0).to(tl.int64)
        rows = ((page * PS + jj % PS) * HKV + kvh) * D
        kv_off = rows[:, None] + d[None, :]
        kv_m = jm[:, None] & dm[None, :]
        k = tl.load(k_cache + kv_off, mask=kv_m, other=0.0)
        v = tl.load(v_cache + kv_off, mask=kv_m, other=0.0)
        if DOT_F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        sc = tl.dot(q, tl.trans(k)) * QK_SCALE                       # [G_PAD, BLOCK_N], log2 units
        sc = tl.where(jm[None, :], sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(sc - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    out_m = gm[:, None] & dm[None, :]
    if n_act <= 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(o_ptr + o_rows, out.to(o_ptr.dtype.element_ty), mask=out_m)
    else:
        # scratch: part_o [B * Hkv * ns, G, D] f32, part_ml [B * Hkv * ns, 2, G] f32 (row bh * ns + s),
        # counter [B * Hkv] i32. B * Hkv * ns < B * Hkv + TARGET_CTAS (the grid formula), so the
        # scratch stays small at large B and is monotone in B (sized once at the runtime's max B)
        po = part_o.to(tl.pointer_type(tl.float32), bitcast=True)
        pml = part_ml.to(tl.pointer_type(tl.float32), bitcast=True)
        bh = b.to(tl.int64) * HKV + kvh
        po_rows = ((bh * ns + s) * G + g)[:, None] * D + d[None, :]
        tl.store(po + po_rows, acc, mask=out_m)
        ml = pml + (bh * ns + s) * (2 * G) + g
        tl.store(ml, m_i, mask=gm)
        tl.store(ml + G, l_i, mask=gm)
        # every thread's partial stores happen before the (single-thread) release of the count
        tl.debug_barrier()
        done = tl.atomic_add(counter + bh, 1, sem="acq_rel", scope="gpu")
        if done == n_act - 1:
            # merge MERGE_CHUNK splits per step (independent loads in flight, not one per split)
            gg = tl.arange(0, G_M)
            ggm = gg < G
            m_t = tl.full([G_M], -1.0e30, tl.float32)
            l_t = tl.zeros([G_M], tl.float32)
            acc_t = tl.zeros([G_M, BLOCK_D], tl.float32)
            for c0 in range(0, n_act, MERGE_CHUNK):
                sp = c0 + tl.arange(0, MERGE_CHUNK)
                base = bh * ns + sp
                mk = (sp < n_act)[:, None] & ggm[None, :]
                ml_off = (base * (2 * G))[:, None] + gg[None, :]
                m_s = tl.load(pml + ml_off, mask=mk, other=-1.0e30, cache_modifier=".cg")      # [chunk, G_M]
                l_s = tl.load(pml + ml_off + G, mask=mk, other=0.0, cache_modifier=".cg")
                o_off = (((base * G)[:, None] + gg[None, :]) * D)[:, :, None] + d[None, None, :]
                o_s = tl.load(po + o_off, mask=mk[:, :, None] & dm[None, None, :], other=0.0,
                              cache_modifier=".cg")                                           # [chunk, G_M, D]
                m_new = tl.maximum(m_t, tl.max(m_s, 0))
                alpha = tl.exp2(m_t - m_new)
                w = tl.exp2(m_s - m_new[None, :])
                l_t = l_t * alpha + tl.sum(l_s * w, 0)
                acc_t = acc_t * alpha[:, None] + tl.sum(o_s * w[:, :, None], 0)
                m_t = m_new
            merged = acc_t / tl.where(l_t > 0, l_t, 1.0)[:, None]
            out_rows = (b.to(tl.int64) * HQ + kvh * G + gg)[:, None] * D + d[None, :]
            tl.store(o_ptr + out_rows, merged.to(o_ptr.dtype.element_ty), mask=ggm[:, None] & dm[None, :])
            tl.atomic_xchg(counter + bh, 0, sem="relaxed", scope="gpu")

META = {
    "entry": "attention_decode",
    "params": [
        ["q_ptr", "*bf16", "in:0"],
        ["k_cache", "*bf16", "cache:k"],
        ["v_cache", "*bf16", "cache:v"],
        ["o_ptr", "*bf16", "out:0"],
        ["block_tables", "*i32", "meta:block_tables"],
        ["context_lens", "*i32", "meta:context_lens"],
        ["max_pages", "i32", "meta:max_pages"],
        ["B", "i32", "dim:B"],
        ["part_o", "*fp32", "scratch:partial_o"],
        ["part_ml", "*fp32", "scratch:partial_ml"],
        ["counter", "*i32", "scratch:counter"],
    ],
    "constexprs": {"HQ": 64, "HKV": 8, "G": 8, "G_PAD": 16, "D": 128,
                   "BLOCK_D": 128, "PS": 16, "BLOCK_N": 64,
                   "G_M": 8, "MERGE_CHUNK": 8,
                   "QK_SCALE": 0.12751743082459868,
                   "WINDOW": 128,
                   "DOT_F32": False, "PDL": True},
    "pdl": True,
    "grid": ["B * 8", "min(32, max(1, cdiv(264, B * 8)))", 1],
    "num_warps": 4,
    "num_stages": 2,
    "scratch": {"partial_o": "(B * 8 + 264) * 4096",
                "partial_ml": "(B * 8 + 264) * 64",
                "counter": "B * 32"},
}
