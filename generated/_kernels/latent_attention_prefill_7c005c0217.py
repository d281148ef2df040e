# latent_attention_prefill: absorbed MLA over ragged sequences (prefill and mixed steps):
# q [T, H=128, Dc + Dr=576], kv [T, 576] (Dc=512, Dr=64), o [T, H, Dc]. Sequence b's new tokens
# are rows seq_starts[b] + i, i < n_b, at positions P + i (P = context_lens[b] - n_b cached keys). Key j
# is Lat[j] = latent[block_tables[b, j // 16], j % 16] for j < P, and kv[seq_starts[b] + j - P] for
# j >= P (this step's rows, read from kv: no program of this launch reads them from the cache).
#   s_ij = q[i, h] . Lat[j] * scale (scale = 0.1352337788608801),  o[i, h] = sum_{j <= P + i} softmax_j(s) Lat[j, :Dc]
# Grid (cdiv(T, BLOCK_M=16) + B, cdiv(H, BLOCK_H=4)): program (p, hb) is the p-th
# (sequence, query block) pair in batch order (found by a walk over the B sequences; at most
# cdiv(T, BLOCK_M) + B pairs exist, programs past the last return) and heads hb * BLOCK_H + [0, BLOCK_H).
# Its tile's rows are r = i * BLOCK_H + hh (all share the one latent "kv head"), so each key tile
# is read once for BLOCK_M * BLOCK_H rows; flash-style online softmax over the causal key range.
# The head-block-0 program of each query block writes its kv rows to their slots (slot_mapping).
import triton
import triton.language as tl


@triton.jit
def latent_attention_prefill(q_ptr, kv_ptr, cache, o_ptr, slot_mapping, block_tables, context_lens,
                             seq_starts, max_pages, B,
                             H: tl.constexpr, D: tl.constexpr, DC: tl.constexpr, DR: tl.constexpr,
                             BLOCK_DC: tl.constexpr, BLOCK_DR: tl.constexpr, PS: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                             QK_SCALE: tl.constexpr, DOT_F32: tl.constexpr):
    pid = tl.program_id(0)
    hb = tl.program_id(1)
    seq = pid * 0 - 1
    blk = pid * 0
    acc_blocks = pid * 0
    for i in range(0, B):
        n_i = tl.load(seq_starts + i + 1) - tl.load(seq_starts + i)
        nb = tl.cdiv(n_i, BLOCK_M)
        hit = (pid >= acc_blocks) & (pid < acc_blocks + nb)
        seq = tl.where(hit, i, seq)
        blk = tl.where(hit, pid - acc_blocks, blk)
        acc_blocks += nb
    if seq < 0:
        return
    start = tl.load(seq_starts + seq)
    n = tl.load(seq_starts + seq + 1) - start
    L = tl.load(context_lens + seq)
    P = L - n
    m0 = blk * BLOCK_M

    dc = tl.arange(0, BLOCK_DC)
    dr = tl.arange(0, BLOCK_DR)
    dcm = dc < DC
    drm = dr < DR
    if hb == 0:
        ii = tl.arange(0, BLOCK_M)
        im = (m0 + ii) < n
        t = (start + m0 + ii).to(tl.int64)
        slot = tl.load(slot_mapping + t, mask=im, other=-1).to(tl.int64)
        wm = im & (slot >= 0)
        xc = tl.load(kv_ptr + (t * D)[:, None] + dc[None, :], mask=wm[:, None] & dcm[None, :], other=0.0)
        tl.store(cache + (slot * D)[:, None] + dc[None, :], xc.to(cache.dtype.element_ty),
                 mask=wm[:, None] & dcm[None, :])
        xr = tl.load(kv_ptr + (t * D)[:, None] + DC + dr[None, :], mask=wm[:, None] & drm[None, :], other=0.0)
        tl.store(cache + (slot * D)[:, None] + DC + dr[None, :], xr.to(cache.dtype.element_ty),
                 mask=wm[:, None] & drm[None, :])

    ROWS: tl.constexpr = BLOCK_M * BLOCK_H
    r = tl.arange(0, ROWS)
    qi = m0 + r // BLOCK_H                       # query index within the sequence
    h = hb * BLOCK_H + r % BLOCK_H
    rm = (qi < n) & (h < H)
    q_rows = ((start + qi).to(tl.int64) * H + h) * D
    q_c = tl.load(q_ptr + q_rows[:, None] + dc[None, :], mask=rm[:, None] & dcm[None, :], other=0.0)
    q_r = tl.load(q_ptr + q_rows[:, None] + DC + dr[None, :], mask=rm[:, None] & drm[None, :], other=0.0)
    if DOT_F32:
        q_c = q_c.to(tl.float32)
        q_r = q_r.to(tl.float32)
    qpos = P + qi

    bt = block_tables + seq.to(tl.int64) * max_pages
    m_i = tl.full([ROWS], -1.0e30, tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_DC], tl.float32)
    end = tl.minimum(L, P + m0 + BLOCK_M)        # the block's last query sees keys < P + m0 + BLOCK_M
    for n0 in range(0, end, BLOCK_N):
        jj = n0 + tl.arange(0, BLOCK_N)
        jm = jj < end
        old = jm & (jj < P)
        new = jm & (jj >= P)
        page = tl.load(bt + jj // PS, mask=old, other=0).to(tl.int64)
        rows = (page * PS + jj % PS) * D
        nrows = (start + jj - P).to(tl.int64) * D
        lc = tl.load(cache + rows[:, None] + dc[None, :], mask=old[:, None] & dcm[None, :], other=0.0)
        lr = tl.load(cache + rows[:, None] + DC + dr[None, :], mask=old[:, None] & drm[None, :], other=0.0)
        nc = tl.load(kv_ptr + nrows[:, None] + dc[None, :], mask=new[:, None] & dcm[None, :], other=0.0)
        nr = tl.load(kv_ptr + nrows[:, None] + DC + dr[None, :], mask=new[:, None] & drm[None, :], other=0.0)
        if DOT_F32:
            lc = lc.to(tl.float32) + nc.to(tl.float32)
            lr = lr.to(tl.float32) + nr.to(tl.float32)
        else:
            lc = lc + nc.to(lc.dtype)
            lr = lr + nr.to(lr.dtype)
        sc = (tl.dot(q_c, tl.trans(lc)) + tl.dot(q_r, tl.trans(lr))) * QK_SCALE   # [ROWS, BLOCK_N], log2 units
        vis = jm[None, :] & (jj[None, :] <= qpos[:, None])
        sc = tl.where(vis, sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(sc - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(lc.dtype), lc)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_rows = (((start + qi).to(tl.int64) * H + h) * DC)[:, None] + dc[None, :]
    tl.store(o_ptr + o_rows, out.to(o_ptr.dtype.element_ty), mask=rm[:, None] & dcm[None, :])

META = {
    "entry": "latent_attention_prefill",
    "params": [
        ["q_ptr", "*bf16", "in:0"],
        ["kv_ptr", "*bf16", "in:1"],
        ["cache", "*bf16", "cache:latent"],
        ["o_ptr", "*bf16", "out:0"],
        ["slot_mapping", "*i32", "meta:slot_mapping"],
        ["block_tables", "*i32", "meta:block_tables"],
        ["context_lens", "*i32", "meta:context_lens"],
        ["seq_starts", "*i32", "meta:seq_starts"],
        ["max_pages", "i32", "meta:max_pages"],
        ["B", "i32", "dim:B"],
    ],
    "constexprs": {"H": 128, "D": 576, "DC": 512, "DR": 64,
                   "BLOCK_DC": 512, "BLOCK_DR": 64, "PS": 16,
                   "BLOCK_M": 16, "BLOCK_H": 4, "BLOCK_N": 32,
                   "QK_SCALE": 0.19510110212326642, "DOT_F32": False},
    "grid": ["cdiv(T, 16) + B", "cdiv(128, 4)", 1],
    "num_warps": 4,
    "num_stages": 2,
}
