# attention_prefill: variable-length causal GQA attention over the paged KV cache, Hq=16,
# Hkv=16 (group G=1), D=256. Sequence b's new tokens are q rows seq_starts[b] ..
# seq_starts[b+1]-1 (q_len of them) and the last q_len of its L = context_lens[b] cached keys, so
# new token i sits at position P + i, P = L - q_len (a cached prefix, maybe shared, comes first):
#   s_j = q[t, h] . K[b, j, h // G] * scale
#   o[t, h] = sum_j softmax_j(s) V[b, j, h // G],  j <= P + i
# K[b, j] = k_cache[block_tables[b, j // 16], j % 16], scale = 0.0625.
# Flash attention: a program owns BLOCK_M=64 rows = TOK=64 consecutive tokens x the G query
# heads of one kv head (GQA packing: K/V tiles are loaded once for the group, and a decode token
# in a mixed step fills G rows, not 1), and streams BLOCK_N=64-key tiles gathered through
# the block table with an online softmax (exp2 of log2-scaled scores). Tiles entirely below the
# block's first position need no mask; the rest are masked causally.
# Grid (cdiv(T, TOK) + B, Hkv): sequence b has cdiv(q_len_b, TOK) blocks, numbered after those of
# sequences < b (sum <= cdiv(T, TOK) + B); each program finds its (b, block) from seq_starts, and
# surplus programs exit.
import triton
import triton.language as tl


@triton.jit
def attention_prefill(q_ptr, k_cache, v_cache, o_ptr, block_tables, context_lens, seq_starts, max_pages,
                      T, B,
                      HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                      BLOCK_D: tl.constexpr, PS: tl.constexpr, BLOCK_M: tl.constexpr, TOK: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, QK_SCALE: tl.constexpr,
                      DOT_F32: tl.constexpr):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)

    # which sequence and q block: count the sequences whose blocks all come before pid
    seq = pid * 0
    first_blk = pid * 0
    carry = pid * 0
    for c in range(0, B, BLOCK_B):
        bi = c + tl.arange(0, BLOCK_B)
        bm = bi < B
        lo = tl.load(seq_starts + bi, mask=bm, other=0)
        hi = tl.load(seq_starts + bi + 1, mask=bm, other=0)
        nblk = (hi - lo + TOK - 1) // TOK
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
    # keys every row of the block sees: [0, prefix + t0]; the block's last token sees up to kv_end - 1
    full_end = ((prefix + t0 + 1) // BLOCK_N) * BLOCK_N
    kv_end = prefix + tl.minimum(t0 + TOK, q_len)
    for n0 in range(0, full_end, BLOCK_N):
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
        jm = jj < kv_end
        page = tl.load(bt + jj // PS, mask=jm, other=0).to(tl.int64)
        kv_off = (((page * PS + jj % PS) * HKV + kvh) * D)[:, None] + d[None, :]
        kv_m = jm[:, None] & dm[None, :]
        k = tl.load(k_cache + kv_off, mask=kv_m, other=0.0)
        v = tl.load(v_cache + kv_off, mask=kv_m, other=0.0)
        if DOT_F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        sc = tl.dot(q, tl.trans(k)) * QK_SCALE
        sc = tl.where(jm[None, :] & (jj[None, :] <= qpos[:, None]), sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(sc - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=q_m)


META = {
    "entry": "attention_prefill",
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
    ],
    "constexprs": {"HQ": 16, "HKV": 16, "G": 1, "D": 256, "BLOCK_D": 256,
                   "PS": 16, "BLOCK_M": 64, "TOK": 64, "BLOCK_N": 64,
                   "BLOCK_B": 256, "QK_SCALE": 0.09016844005556021,
                   "DOT_F32": False},
    "grid": ["cdiv(T, 64) + B", 16, 1],
    "num_warps": 8,
    "num_stages": 3,
}
