# attention_decode: one new token per sequence (row b of q [B, Hq=24, D=128]), causal over its
# whole paged cache (context_lens[b] = L keys, the new token's included), GQA group G=3:
#   s_j = q[b, h] . K[b, j, h // G] * scale
#   o[b, h] = sum_j softmax_j(s) V[b, j, h // G],  j < L
# with K[b, j] = k_cache[block_tables[b, j // 16], j % 16] and scale = 0.08838834764831845.
# Grid (B * Hkv, ns): one program per (sequence, kv head, split) covers the G query heads of its kv
# head (padded to G_PAD=16 rows for tl.dot) so K/V are read once. ns = min(NUM_SPLITS=32,
# max(1, cdiv(TARGET_CTAS=264, B * Hkv))) splits only as far as needed to fill the GPU.
# Split s owns keys [s * kps, (s + 1) * kps), kps = ceil(ceil(L / ns) / BLOCK_N) * BLOCK_N (whole
# pages); only the n = cdiv(L, kps) non-empty splits run.
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
# Merged in front (narrow steps): qk_norm_rope_cache of each sequence's new token, by every
# active split of (b, kv head) for its G query heads and its kv head, into the scratch q and the
# caches at slot_mapping[b] (the splits write the same bits; the one that holds key L - 1 reads
# it back after a CTA barrier, the others never read it). A speculative verify step's rows
# (runtime/engine/speculative/) are one-token rows of one sequence at consecutive positions, so a
# row reads keys that its sequence's earlier rows write in this same launch, in no order with it:
# each split also writes the K/V of those rows (found by their slots: slot_mapping[r] is the
# slot of positions[r] in row b's block table) whose keys it reads, the same bits their own
# programs write, and reads them back after its barrier with its own; first_new, the first such
# position, is L - 1 in a plain decode step (no such row). Before its PDL wait the launch reads
# only what no kernel of the step writes (META reads_before_wait: tests/test_dependent_launch.py):
# metadata, norm weights, and its first key block below L - 1, so those loads overlap the qkv GEMV:
# for a token t at position p = positions[t] and slot s = slot_mapping[t]:
#   q[t, h]   = rope(q_h, p)
#   K[s, kh]  = rope(k_kh, p)                -> cache:k [pages, page_size, Hkv, D]
#   V[s, kh]  = v_kh                                                     -> cache:v
# rms_norm(x, w) = bf16(bf16(x / sqrt(mean(x^2) + eps)) * w) (eps=0.0) over all D dims: HF rounds the
# normalized head to bf16, then multiplies by the bf16 weight and rounds again (Llama's order).
# rope(x, p) on the first R=64 dims (rotate-half; x1, x2 the two halves of x[:R]; x[R:] passes through):
#   [x1 cos - x2 sin, x2 cos + x1 sin, x[R:]],  cos/sin of a_j = f32(p) * f32(inv_freq_j),
#   inv_freq_j = theta^(-2j/R) (theta=10000), computed in fp64 in the kernel,
#   from the absolute position (no table, so no position limit); the angle is reduced mod 2 pi
#   (two-constant Cody-Waite) before cos/sin, so cos/sin of the fp32 angle stay accurate at any
#   position (no reliance on the hardware's range reduction).
# A slot < 0 (padding rows) writes nothing to the cache.
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def attention_decode(q_ptr, k_cache, v_cache, o_ptr, block_tables, context_lens, max_pages, B,
                     part_o, part_ml, counter, qkv_ptr, pos_ptr, slot_ptr,
                     HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
                     D: tl.constexpr, BLOCK_D: tl.constexpr, PS: tl.constexpr, BLOCK_N: tl.constexpr,
                     G_M: tl.constexpr, MERGE_CHUNK: tl.constexpr,
                     QK_SCALE: tl.constexpr,
                     BLOCK_H: tl.constexpr, R_PAD: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, PASS: tl.constexpr, BLOCK_PASS: tl.constexpr, EPS: tl.constexpr, THETA: tl.constexpr, ROT: tl.constexpr,
                     DOT_F32: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
    pid = tl.program_id(0)
    b = pid // HKV
    kvh = pid % HKV
    s = tl.program_id(1)
    ns = tl.num_programs(1)
    L = tl.load(context_lens + b)
    kps = tl.maximum(tl.cdiv(tl.cdiv(L, ns), BLOCK_N) * BLOCK_N, BLOCK_N)
    n_act = tl.cdiv(L, kps)
    if s >= tl.maximum(n_act, 1):
        return

    g = tl.arange(0, G_PAD)
    d = tl.arange(0, BLOCK_D)
    gm = g < G
    dm = d < D
    o_rows = (b.to(tl.int64) * HQ + kvh * G + g)[:, None] * D + d[None, :]
    start = s * kps
    end = tl.minimum(start + kps, L)
    bt = block_tables + b.to(tl.int64) * max_pages

    # first_new: the first key this launch writes for row b's sequence (its own at L - 1, and in
    # a speculative build's narrow program, a verify step's earlier rows of the sequence: rows r
    # whose slot is positions[r]'s in b's table)
    first_new = L - 1

    # Before the PDL wait, only what no kernel of this step writes: the step's metadata, the norm
    # weights, and the split's first key block below first_new (keys of earlier steps; this launch
    # writes the step's, from first_new on, after the wait, and reads them after its barrier)
    jj0 = start + tl.arange(0, BLOCK_N)
    jm0 = jj0 < end
    page0 = tl.load(bt + jj0 // PS, mask=jm0, other=0).to(tl.int64)
    rows0 = ((page0 * PS + jj0 % PS) * HKV + kvh) * D
    kv_off0 = rows0[:, None] + d[None, :]
    kv_m0 = jm0[:, None] & dm[None, :]
    k0 = tl.load(k_cache + kv_off0, mask=kv_m0 & (jj0 < first_new)[:, None], other=0.0)
    v0 = tl.load(v_cache + kv_off0, mask=kv_m0 & (jj0 < first_new)[:, None], other=0.0)

    # the merged qk_norm_rope_cache: heads kvh * G .. + G - 1 of q, then k head kvh (index HQ + kvh)
    hh = tl.arange(0, BLOCK_H)
    is_q = hh < G
    hm = hh <= G
    h = tl.where(is_q, kvh * G + hh, HQ + kvh)
    j = tl.arange(0, BLOCK_HALF)
    j_ok = j < HALF
    m2 = hm[:, None] & j_ok[None, :]
    W: tl.constexpr = (HQ + 2 * HKV) * D
    # inv_freq in fp64 (as the reference computes it), rounded to fp32; once per program
    log2_theta = tl.log2(tl.full([], THETA, tl.float64))
    freq = tl.exp2(j.to(tl.float64) * (log2_theta * tl.full([], -2.0 / ROT, tl.float64)))
    freq = freq.to(tl.float32)
    # dims R..D-1: normed, not rotated
    pj = 2 * HALF + tl.arange(0, BLOCK_PASS)
    pm = hm[:, None] & (pj < D)[None, :]

    tc = b.to(tl.int64)                     # a decode step: sequence b's one token is row b
    t_ok = hh >= 0
    pos = tl.load(pos_ptr + tc).to(tl.float32)
    slot = tl.load(slot_ptr + tc).to(tl.int64)
    ang = pos * freq
    # reduce mod 2 pi: C1 + C2 = 2 pi to ~1e-15; k * C1 is exact in the fma
    k2pi = tl.floor(ang * 0.15915493667125702 + 0.5)
    r = tl.fma(k2pi, -6.2831854820251465, ang)
    r = tl.fma(k2pi, 1.7484555314695172e-07, r)
    cos = tl.cos(r)[None, :]
    sin = tl.sin(r)[None, :]
    if PDL:
        gdc_wait()   # earlier kernels' writes are visible from here on
    # q goes through scratch (untyped bytes: the interpreter hands int32) in qkv's dtype
    q_ptr = q_ptr.to(tl.pointer_type(qkv_ptr.dtype.element_ty), bitcast=True)
    # every load comes before the first store (a load after a store waits for it: the compiler cannot
    # tell the pointers apart); q and k heads are consecutive D-wide column groups of the qkv row, each
    # k head's v head Hkv heads further on
    src = qkv_ptr + tc * W + h[:, None] * D + j[None, :]
    x1 = tl.load(src, mask=m2, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=m2, other=0.0).to(tl.float32)
    is_k = hm & ~is_q & t_ok
    v1 = tl.load(src + HKV * D, mask=m2 & is_k[:, None], other=0.0)
    v2 = tl.load(src + HKV * D + HALF, mask=m2 & is_k[:, None], other=0.0)
    srcp = qkv_ptr + tc * W + h[:, None] * D + pj[None, :]
    xp = tl.load(srcp, mask=pm, other=0.0).to(tl.float32)
    vp = tl.load(srcp + HKV * D, mask=pm & is_k[:, None], other=0.0)
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin

    # q heads -> q[t, h, :]
    dst_q = q_ptr + tc * (HQ * D) + h[:, None] * D + j[None, :]
    qm = m2 & (is_q & t_ok)[:, None]
    tl.store(dst_q, o1.to(q_ptr.dtype.element_ty), mask=qm)
    tl.store(dst_q + HALF, o2.to(q_ptr.dtype.element_ty), mask=qm)

    # k heads -> K cache at the token's slot; v heads (Hkv columns further on) -> V cache
    kh = h - HQ
    k_ok = is_k & (tl.zeros([BLOCK_H], tl.int64) + slot >= 0)
    km = m2 & k_ok[:, None]
    dst_k = k_cache + slot * (HKV * D) + kh[:, None] * D + j[None, :]
    tl.store(dst_k, o1.to(k_cache.dtype.element_ty), mask=km)
    tl.store(dst_k + HALF, o2.to(k_cache.dtype.element_ty), mask=km)
    dst_v = v_cache + slot * (HKV * D) + kh[:, None] * D + j[None, :]
    tl.store(dst_v, v1.to(v_cache.dtype.element_ty), mask=km)
    tl.store(dst_v + HALF, v2.to(v_cache.dtype.element_ty), mask=km)
    # the pass-through dims: q, K (normed, unrotated) and V
    qpm = pm & (is_q & t_ok)[:, None]
    tl.store(q_ptr + tc * (HQ * D) + h[:, None] * D + pj[None, :], xp.to(q_ptr.dtype.element_ty), mask=qpm)
    kpm = pm & k_ok[:, None]
    dst_kp = slot * (HKV * D) + kh[:, None] * D + pj[None, :]
    tl.store(k_cache + dst_kp, xp.to(k_cache.dtype.element_ty), mask=kpm)
    tl.store(v_cache + dst_kp, vp.to(v_cache.dtype.element_ty), mask=kpm)
    tl.debug_barrier()                      # the CTA's q and K/V stores, visible to its threads
    q = tl.load(q_ptr + o_rows, mask=gm[:, None] & dm[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    new = kv_m0 & (jj0 >= first_new)[:, None]
    k0 = tl.load(k_cache + kv_off0, mask=new, other=k0)
    v0 = tl.load(v_cache + kv_off0, mask=new, other=v0)
    m_i = tl.full([G_PAD], -1.0e30, tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, BLOCK_D], tl.float32)
    if DOT_F32:
        k0 = k0.to(tl.float32)
        v0 = v0.to(tl.float32)
    sc0 = tl.dot(q, tl.trans(k0)) * QK_SCALE                       # [G_PAD, BLOCK_N], log2 units
    sc0 = tl.where(jm0[None, :], sc0, float("-inf"))
    m_new0 = tl.maximum(m_i, tl.max(sc0, 1))
    alpha0 = tl.exp2(m_i - m_new0)
    p0 = tl.exp2(sc0 - m_new0[:, None])
    l_i = l_i * alpha0 + tl.sum(p0, 1)
    acc = acc * alpha0[:, None] + tl.dot(p0.to(v0.dtype), v0)
    m_i = m_new0
    for n0 in range(start + BLOCK_N, end, BLOCK_N):
        jj = n0 + tl.arange(0, BLOCK_N)
        jm = jj < end
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
        ["q_ptr", "*bf16", "scratch:q"],
        ["k_cache", "*bf16", "cache:k"],
        ["v_cache", "*bf16", "cache:v"],
        ["o_ptr", "*bf16", "out:1"],
        ["block_tables", "*i32", "meta:block_tables"],
        ["context_lens", "*i32", "meta:context_lens"],
        ["max_pages", "i32", "meta:max_pages"],
        ["B", "i32", "dim:B"],
        ["part_o", "*fp32", "scratch:partial_o"],
        ["part_ml", "*fp32", "scratch:partial_ml"],
        ["counter", "*i32", "scratch:counter"],
        ["qkv_ptr", "*bf16", "in:0"],
        ["pos_ptr", "*i32", "meta:positions"],
        ["slot_ptr", "*i32", "meta:slot_mapping"],
    ],
    "constexprs": {"HQ": 24, "HKV": 8, "G": 3, "G_PAD": 16, "D": 128,
                   "BLOCK_D": 128, "PS": 16, "BLOCK_N": 64,
                   "G_M": 4, "MERGE_CHUNK": 8,
                   "QK_SCALE": 0.12751743082459868,
                   "BLOCK_H": 4, "R_PAD": 8, "HALF": 32, "BLOCK_HALF": 32, "PASS": 64, "BLOCK_PASS": 64,
                   "EPS": 0.0, "THETA": 10000.0, "ROT": 64,
                   "DOT_F32": False, "PDL": True},
    "pdl": True,
    "reads_before_wait": ["context_lens", "block_tables", "k_cache", "v_cache", "pos_ptr", "slot_ptr"],
    "grid": ["B * 8", "min(32, max(1, cdiv(264, B * 8)))", 1],
    "num_warps": 4,
    "num_stages": 2,
    "scratch": {"partial_o": "(B * 8 + 264) * 1536",
                "partial_ml": "(B * 8 + 264) * 24",
                "counter": "B * 32",
                "q": "B * 6144"},
}
