# attention_prefill: variable-length causal GQA attention over the paged KV cache, Hq=64,
# Hkv=8 (group G=8), D=128. Sequence b's new tokens are q rows seq_starts[b] ..
# seq_starts[b+1]-1 (q_len of them) and the last q_len of its L = context_lens[b] cached keys, so
# new token i sits at position P + i, P = L - q_len (a cached prefix, maybe shared, comes first):
#   s_j = q[t, h] . K[b, j, h // G] * scale
#   o[t, h] = sum_j softmax_j(s) V[b, j, h // G],  j <= P + i and P + i - j < window (window = 128, HF's sliding window)
# K[b, j] = k_cache[block_tables[b, j // 16], j % 16], scale = 0.08838834764831845.
# Flash attention: a program owns BLOCK_M=128 rows = TOK=16 consecutive tokens x the G query
# heads of one kv head (GQA packing: K/V tiles are loaded once for the group, and a decode token
# in a mixed step fills G rows, not 1), and streams BLOCK_N=128-key tiles gathered through
# the block table with an online softmax (exp2 of log2-scaled scores). Tiles entirely below the
# block's first position and at or above its last position's window start need no mask; the
# tiles before (window) and after (causal) them are masked, and keys below the first position's
# window start are never read (their tiles are not visited, nor loaded in the first visited one).
# attention_mixed (the mixed phase): one launch, two roles. Programs [0, (cdiv(T, TOK) + B) * Hkv)
# are the flash role above, program p on kv head p % Hkv and block p // Hkv, for the sequences of
# more than QMAX=1 new tokens only (sequence b has cdiv(q_len_b, TOK) blocks if q_len_b > QMAX,
# else none, numbered after those of sequences < b; surplus programs exit). The split-KV role
# below (the programs after them) serves the sequences of at most QMAX new tokens.
import triton
import triton.language as tl
# Split-KV role (sequences with q_len <= QMAX=1): one program per (sequence b, kv head, split),
# ns = min(NUM_SPLITS=32, max(1, cdiv(TARGET_CTAS=264, B * Hkv))) splits. Its rows are
# r = i * G + g for new token i < q_len (position P + i, P = L - q_len) and query head kvh * G + g
# (QMAX * G = 8 rows, padded to 16 for tl.dot), so the K/V of a split are read once for all of them.
# A split takes at least SPLIT_MIN_KEYS=256 keys: below that, its partials and the merge cost more than
# the keys it saves the others.
# Keys from lo0 = floor(lo / BLOCK_N) * BLOCK_N, lo = max(P - WINDOW + 1, 0) (the first row's window
# start); split s owns lo0 + [s * kps, (s + 1) * kps); row r sees P + i - WINDOW < j <= P + i.
# Each split runs the online softmax; with more than one non-empty split, the partial (acc, m, l)
# go to scratch and the split that arrives last merges them (attention_decode's protocol: a CTA
# barrier, one acq_rel atomic on the (b, kv head) counter, .cg loads, counter back to 0):
#   M = max_s m_s, o = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s.
# Partials are written only when ns > 1, i.e. B * Hkv < TARGET_CTAS, so (b * Hkv + kvh) * ns + s
# < 2 * TARGET_CTAS rows of scratch always suffice.


@triton.jit
def _attend_split(pid, q_ptr, k_cache, v_cache, o_ptr, block_tables, context_lens, seq_starts,
                  max_pages, B, part_o, part_ml, counter, DOT_F32: tl.constexpr):
    HQ: tl.constexpr = 64
    HKV: tl.constexpr = 8
    G: tl.constexpr = 8
    D: tl.constexpr = 128
    BLOCK_D: tl.constexpr = 128
    PS: tl.constexpr = 16
    BLOCK_N: tl.constexpr = 64
    ROWS: tl.constexpr = 8
    M: tl.constexpr = 16
    MM: tl.constexpr = 8
    CHUNK: tl.constexpr = 4
    ns = tl.minimum(32, tl.maximum(1, tl.cdiv(264, B * HKV)))
    bh = pid // ns
    s = pid % ns
    b = bh // HKV
    kvh = bh % HKV
    if b >= B:
        return
    q_start = tl.load(seq_starts + b)
    q_len = tl.load(seq_starts + b + 1) - q_start
    if q_len > 1:
        return                                                     # the flash role's
    L = tl.load(context_lens + b)
    P = L - q_len
    lo = tl.maximum(P - 128 + 1, 0)
    lo0 = (lo // BLOCK_N) * BLOCK_N
    kps = tl.maximum(tl.cdiv(tl.cdiv(L - lo0, ns), BLOCK_N) * BLOCK_N, 256)
    n_act = tl.cdiv(L - lo0, kps)
    if s >= tl.maximum(n_act, 1):
        return

    r = tl.arange(0, M)
    i = r // G
    row_ok = (r < ROWS) & (i < q_len)
    qpos = P + i
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    o_rows = ((q_start + i).to(tl.int64) * HQ + kvh * G + r % G)[:, None] * D + d[None, :]
    q = tl.load(q_ptr + o_rows, mask=row_ok[:, None] & dm[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)

    start = lo0 + s * kps
    end = tl.minimum(start + kps, L)
    bt = block_tables + b.to(tl.int64) * max_pages
    m_i = tl.full([M], -1.0e30, tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        jj = n0 + tl.arange(0, BLOCK_N)
        jm = (jj < end) & (jj >= lo)                               # no row sees a key below lo
        page = tl.load(bt + jj // PS, mask=jm, other=0).to(tl.int64)
        kv_off = (((page * PS + jj % PS) * HKV + kvh) * D)[:, None] + d[None, :]
        kv_m = jm[:, None] & dm[None, :]
        k = tl.load(k_cache + kv_off, mask=kv_m, other=0.0)
        v = tl.load(v_cache + kv_off, mask=kv_m, other=0.0)
        if DOT_F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        sc = tl.dot(q, tl.trans(k)) * 0.12751743082459868            # log2 units
        seen = jm[None, :] & (jj[None, :] <= qpos[:, None]) & (jj[None, :] > qpos[:, None] - 128)
        sc = tl.where(seen, sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(sc - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    out_m = row_ok[:, None] & dm[None, :]
    if n_act <= 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(o_ptr + o_rows, out.to(o_ptr.dtype.element_ty), mask=out_m)
    else:
        # scratch rows (bh * ns + s) * ROWS + r: part_o f32 [.., D], part_ml f32 [.., 2, ROWS]
        po = part_o.to(tl.pointer_type(tl.float32), bitcast=True)
        pml = part_ml.to(tl.pointer_type(tl.float32), bitcast=True)
        part = bh.to(tl.int64) * ns + s
        keep = r < ROWS
        tl.store(po + ((part * ROWS + r) * D)[:, None] + d[None, :], acc, mask=keep[:, None] & dm[None, :])
        ml = pml + part * (2 * ROWS) + r
        tl.store(ml, m_i, mask=keep)
        tl.store(ml + ROWS, l_i, mask=keep)
        tl.debug_barrier()
        done = tl.atomic_add(counter + bh, 1, sem="acq_rel", scope="gpu")
        if done == n_act - 1:
            rr = tl.arange(0, MM)
            rk = (rr < ROWS) & (rr // G < q_len)
            m_t = tl.full([MM], -1.0e30, tl.float32)
            l_t = tl.zeros([MM], tl.float32)
            acc_t = tl.zeros([MM, BLOCK_D], tl.float32)
            for c0 in range(0, n_act, CHUNK):
                sp = c0 + tl.arange(0, CHUNK)
                base = bh.to(tl.int64) * ns + sp
                mk = (sp < n_act)[:, None] & rk[None, :]
                ml_off = (base * (2 * ROWS))[:, None] + rr[None, :]
                m_s = tl.load(pml + ml_off, mask=mk, other=-1.0e30, cache_modifier=".cg")    # [CHUNK, MM]
                l_s = tl.load(pml + ml_off + ROWS, mask=mk, other=0.0, cache_modifier=".cg")
                o_off = (((base * ROWS)[:, None] + rr[None, :]) * D)[:, :, None] + d[None, None, :]
                o_s = tl.load(po + o_off, mask=mk[:, :, None] & dm[None, None, :], other=0.0,
                              cache_modifier=".cg")                                         # [CHUNK, MM, D]
                m_new = tl.maximum(m_t, tl.max(m_s, 0))
                alpha = tl.exp2(m_t - m_new)
                w = tl.exp2(m_s - m_new[None, :])
                l_t = l_t * alpha + tl.sum(l_s * w, 0)
                acc_t = acc_t * alpha[:, None] + tl.sum(o_s * w[:, :, None], 0)
                m_t = m_new
            merged = acc_t / tl.where(l_t > 0, l_t, 1.0)[:, None]
            out_rows = ((q_start + rr // G).to(tl.int64) * HQ + kvh * G + rr % G)[:, None] * D + d[None, :]
            tl.store(o_ptr + out_rows, merged.to(o_ptr.dtype.element_ty), mask=rk[:, None] & dm[None, :])
            tl.atomic_xchg(counter + bh, 0, sem="relaxed", scope="gpu")


@triton.jit
def attention_mixed(q_ptr, k_cache, v_cache, o_ptr, block_tables, context_lens, seq_starts, max_pages,
                      T, B,
                      part_o, part_ml, counter,
                      HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                      BLOCK_D: tl.constexpr, PS: tl.constexpr, BLOCK_M: tl.constexpr, TOK: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, QK_SCALE: tl.constexpr,
                      WINDOW: tl.constexpr,
                      DOT_F32: tl.constexpr):
    pid = tl.program_id(0)
    n_flash = (tl.cdiv(T, TOK) + B) * HKV
    if pid >= n_flash:
        _attend_split(pid - n_flash, q_ptr, k_cache, v_cache, o_ptr, block_tables, context_lens,
                      seq_starts, max_pages, B, part_o, part_ml, counter, DOT_F32)
        return
    kvh = pid % HKV
    pid = pid // HKV

    # which sequence and q block: count the sequences whose blocks all come before pid
    seq = pid * 0
    first_blk = pid * 0
    carry = pid * 0
    for c in range(0, B, BLOCK_B):
        bi = c + tl.arange(0, BLOCK_B)
        bm = bi < B
        lo = tl.load(seq_starts + bi, mask=bm, other=0)
        hi = tl.load(seq_starts + bi + 1, mask=bm, other=0)
        nblk = tl.where(hi - lo > 1, (hi - lo + TOK - 1) // TOK, 0)
        before = (tl.cumsum(nblk, 0) + carry <= pid) & bm
        seq += tl.sum(before.to(tl.int32), 0)
        first_blk += tl.sum(tl.where(before, nblk, 0), 0)
        carry += tl.sum(nblk, 0)
    if seq >= B:
        return

    q_start = tl.load(seq_starts + seq)
    q_len = tl.load(seq_starts + seq + 1) - q_start
    L = tl.load(context_lens + seq)
    prefix = L - q_len
    t0 = (pid - first_blk) * TOK                                   # first token of this block

    r = tl.arange(0, BLOCK_M)
    tok = t0 + r // G
    head = kvh * G + r % G
    row_ok = (r < TOK * G) & (tok < q_len)
    qpos = prefix + tok
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    o_off = ((q_start + tok).to(tl.int64) * HQ + head)[:, None] * D + d[None, :]
    q_m = row_ok[:, None] & dm[None, :]
    q = tl.load(q_ptr + o_off, mask=q_m, other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)

    bt = block_tables + seq.to(tl.int64) * max_pages
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # positions of the block's rows: [prefix + t0, kv_end - 1]. Keys every row sees: [kv_end - WINDOW,
    # prefix + t0] (unmasked tiles [mid_lo, full_end)); below, back to the first row's window start
    # prefix + t0 - WINDOW + 1, and above, up to kv_end - 1, tiles are masked
    kv_end = prefix + tl.minimum(t0 + TOK, q_len)
    full_end = ((prefix + t0 + 1) // BLOCK_N) * BLOCK_N
    full_lo = tl.cdiv(tl.maximum(kv_end - WINDOW, 0), BLOCK_N) * BLOCK_N
    mid_lo = tl.minimum(full_lo, full_end)
    lo = tl.maximum(prefix + t0 - WINDOW + 1, 0)
    lo_tile = (lo // BLOCK_N) * BLOCK_N
    for n0 in range(lo_tile, mid_lo, BLOCK_N):
        jj = n0 + tl.arange(0, BLOCK_N)
        jm = (jj < kv_end) & (jj >= lo)                              # keys below lo: no row sees them
        page = tl.load(bt + jj // PS, mask=jm, other=0).to(tl.int64)
        kv_off = (((page * PS + jj % PS) * HKV + kvh) * D)[:, None] + d[None, :]
        kv_m = jm[:, None] & dm[None, :]
        k = tl.load(k_cache + kv_off, mask=kv_m, other=0.0)
        v = tl.load(v_cache + kv_off, mask=kv_m, other=0.0)
        if DOT_F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        sc = tl.dot(q, tl.trans(k)) * QK_SCALE
        sc = tl.where(jm[None, :] & (jj[None, :] <= qpos[:, None]) & (jj[None, :] > qpos[:, None] - WINDOW),
                      sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(sc - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    for n0 in range(mid_lo, full_end, BLOCK_N):
        jj = n0 + tl.arange(0, BLOCK_N)
        page = tl.load(bt + jj // PS).to(tl.int64)
        kv_off = (((page * PS + jj % PS) * HKV + kvh) * D)[:, None] + d[None, :]
        k = tl.load(k_cache + kv_off, mask=dm[None, :], other=0.0)
        v = tl.load(v_cache + kv_off, mask=dm[None, :], other=0.0)
        if DOT_F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        sc = tl.dot(q, tl.trans(k)) * QK_SCALE
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(sc - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    for n0 in range(full_end, kv_end, BLOCK_N):
        jj = n0 + tl.arange(0, BLOCK_N)
        jm = (jj < kv_end) & (jj >= lo)                              # keys below lo: no row sees them
        page = tl.load(bt + jj // PS, mask=jm, other=0).to(tl.int64)
        kv_off = (((page * PS + jj % PS) * HKV + kvh) * D)[:, None] + d[None, :]
        kv_m = jm[:, None] & dm[None, :]
        k = tl.load(k_cache + kv_off, mask=kv_m, other=0.0)
        v = tl.load(v_cache + kv_off, mask=kv_m, other=0.0)
        if DOT_F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        sc = tl.dot(q, tl.trans(k)) * QK_SCALE
        sc = tl.where(jm[None, :] & (jj[None, :] <= qpos[:, None]) & (jj[None, :] > qpos[:, None] - WINDOW),
                      sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(sc - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=q_m)


META = {
    "entry": "attention_mixed",
    "params": [
        ["q_ptr", "*bf16", "in:0"],
        ["k_cache", "*bf16", "cache:k"],
        ["v_cache", "*bf16", "cache:v"],
        ["o_ptr", "*bf16", "out:0"],
        ["block_tables", "*i32", "meta:block_tables"],
        ["context_lens", "*i32", "meta:context_lens"],
        ["seq_starts", "*i32", "meta:seq_starts"],
        ["max_pages", "i32", "meta:max_pages"],
        ["T", "i32", "dim:T"],
        ["B", "i32", "dim:B"],
        ["part_o", "*fp32", "scratch:partial_o"],
        ["part_ml", "*fp32", "scratch:partial_ml"],
        ["counter", "*i32", "scratch:counter"],
    ],
    "constexprs": {"HQ": 64, "HKV": 8, "G": 8, "D": 128, "BLOCK_D": 128,
                   "PS": 16, "BLOCK_M": 128, "TOK": 16, "BLOCK_N": 128,
                   "BLOCK_B": 256, "QK_SCALE": 0.12751743082459868,
                   "WINDOW": 128,
                   "DOT_F32": False},
    "grid": ["(cdiv(T, 16) + B) * 8 + B * 8 * min(32, max(1, cdiv(264, B * 8)))", 1, 1],
    "scratch": {"partial_o": "2162688",
                "partial_ml": "33792",
                "counter": "1056"},
    "num_warps": 8,
    "num_stages": 3,
}
