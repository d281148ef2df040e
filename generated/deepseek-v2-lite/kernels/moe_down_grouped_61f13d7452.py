# moe_down (grouped): y[t, h] = bf16(sum_j bf16(r[t, j] * sum_f act[t, j, f] * w[e, h, f])),  e = ids[t, j]
#   act [T, 6, 1408] bf16, r f32 [T, 6], ids i32 [T, 6], w [64, 2048, 1408] bf16,
#   rows i32 [64, T] / counts i32 [64] (moe_align: the tokens of each expert), y [T, 2048] bf16;
#   fp32 sums; each slot's weighted sum is rounded to bf16 once before the slots are added (in fp32).
#
# Many tokens: the grouped GEMM of moe_gate_up_grouped.py.j2 (row blocks of BLOCK_M tokens of one
# expert, gathered act rows: token t's act[t, j] for the slot j that chose e, of largest weight if
# several did; 16 column tiles of BLOCK_H = 128 output rows; GROUP_M ordering), then a combine
# that needs no atomics on floats: a program parks r[t, j] * (its sums) in a bf16 scratch
# [T, 6, 2048] for every slot j of t that chose e and counts itself in at the token's tile
# (t, column tile); the program that completes the token's distinct experts adds its 6 partials
# in slot order and writes y[t] (the same bits whatever order the experts finish in), leaving the
# counter zero.
import triton
import triton.language as tl


@triton.jit
def _ptr(base, offs):
    """base + offs, with the 16-byte alignment of each contiguous run of 8 bf16 made known to the
    compiler (rows are multiples of 8 elements and buffers 16-byte aligned), for vector loads."""
    p = base + offs
    p = tl.multiple_of(p, [1, 16])
    return p


@triton.jit
def _block_of(counts_ptr, pid_m, E: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr):
    """Row block pid_m of the experts' token lists cut in BLOCK_M blocks (expert 0's blocks first):
    (expert, first list index of the block, tokens of the expert); expert == E past the last block."""
    ex = tl.arange(0, BLOCK_E)
    cnt = tl.load(counts_ptr + ex, mask=ex < E, other=0)
    nblk = (cnt + BLOCK_M - 1) // BLOCK_M
    end = tl.cumsum(nblk, 0)
    e = tl.sum((end <= pid_m).to(tl.int32), 0)
    sel = ex == e
    first = tl.sum(tl.where(sel, end - nblk, 0), 0)
    return e, (pid_m - first) * BLOCK_M, tl.sum(tl.where(sel, cnt, 0), 0)


@triton.jit
def _mine(ids_ptr, toks, ok, e, KT: tl.constexpr, KTP: tl.constexpr):
    """Token rows' ids [NT, KTP] (-1 past KT or where not ok), which slots name expert e, the first
    of them and whether any row names e more than once (ep_dispatch's zero-weight slots)."""
    j = tl.arange(0, KTP)
    idt = tl.load(ids_ptr + toks.to(tl.int64)[:, None] * KT + j[None, :],
                  mask=ok[:, None] & (j[None, :] < KT), other=-1)
    mine = idt == e
    first = tl.min(tl.where(mine, j[None, :], KTP), 1)
    again = tl.max(tl.sum(mine.to(tl.int32), 1), 0) > 1
    return idt, mine, first, again


@triton.jit
def _main_slot(ids_ptr, rw_ptr, toks, ok, e, KT: tl.constexpr):
    """For each token t that chose expert e, the slot j whose act row the down projection reads:
    the one of largest routing weight among the slots naming e (the first on ties). A token names
    an expert in several slots only as ep_dispatch leaves it: the extra slots weigh 0, so they add
    nothing whichever row they are given."""
    best = tl.zeros_like(toks)
    best_r = tl.full(toks.shape, -1.0, tl.float32)
    for jj in tl.static_range(KT):
        t_j = toks.to(tl.int64) * KT + jj
        ej = tl.load(ids_ptr + t_j, mask=ok, other=-1)
        rj = tl.load(rw_ptr + t_j, mask=ok, other=0.0)
        better = (ej == e) & (rj > best_r)
        best = tl.where(better, jj, best)
        best_r = tl.where(better, rj, best_r)
    return best


@triton.jit
def _down_finish(acc, toks, ok, e, offs_h, nb, ids_ptr, rw_ptr, y_ptr, part_ptr, cnt_ptr,
                 H: tl.constexpr, KT: tl.constexpr, KTP: tl.constexpr, NB: tl.constexpr,
                 PDT: tl.constexpr):
    """acc [NT, BH] fp32: expert e's down projection of tokens toks (where ok), columns offs_h
    (column block nb). Parks r[t, j] * acc as the partial sum of every slot j of t that chose e
    (PDT: fp32 or bf16 scratch [T, KT, H]), then counts the expert in at the token's tile (t, nb);
    the program that brings the count to the token's number of distinct experts sums the token's
    KT partials in slot order j = 0 .. KT-1 (a fixed order: the same bits whatever order the
    experts arrive in), writes y[t] and leaves the counter zero."""
    j = tl.arange(0, KTP)
    t64 = toks.to(tl.int64)
    h_mask = offs_h < H
    pp = part_ptr.to(tl.pointer_type(PDT), bitcast=True)
    idt, mine, first, again = _mine(ids_ptr, toks, ok, e, KT, KTP)
    r = tl.load(rw_ptr + t64 * KT + first, mask=ok, other=0.0)
    tl.store(pp + (t64 * KT + first)[:, None] * H + offs_h[None, :], (acc * r[:, None]).to(PDT),
             mask=ok[:, None] & h_mask[None, :])
    if again:                # a token naming e in more slots: the same sums, their own weights
        for jj in tl.static_range(1, KT):
            ej = tl.sum(tl.where(j[None, :] == jj, idt, 0), 1)
            more = ok & (ej == e) & (first < jj)
            r = tl.load(rw_ptr + t64 * KT + jj, mask=more, other=0.0)
            tl.store(pp + (t64 * KT + jj)[:, None] * H + offs_h[None, :], (acc * r[:, None]).to(PDT),
                     mask=more[:, None] & h_mask[None, :])
    # the token's distinct experts: slots that no earlier slot of the token repeats
    experts = tl.zeros_like(toks)
    for jj in tl.static_range(KT):
        ej = tl.sum(tl.where(j[None, :] == jj, idt, 0), 1)
        seen = tl.max(((j[None, :] < jj) & (idt == ej[:, None])).to(tl.int32), 1)
        experts += (ok & (seen == 0)).to(tl.int32)
    tl.debug_barrier()   # every thread's partials are issued before the release below
    arrived = tl.atomic_add(cnt_ptr + t64 * NB + nb, 1, mask=ok, sem="acq_rel")
    last = ok & (arrived == experts - 1)
    tl.debug_barrier()   # the whole program reads after the acquire above
    total = tl.zeros_like(acc)
    for jj in range(KT):     # a loop, not unrolled: one slot's tile in registers at a time
        got = tl.load(pp + (t64 * KT + jj)[:, None] * H + offs_h[None, :],
                      mask=last[:, None] & h_mask[None, :], other=0.0, cache_modifier=".cg")
        total += got.to(tl.float32)
    tl.store(y_ptr + t64[:, None] * H + offs_h[None, :], total.to(y_ptr.dtype.element_ty),
             mask=last[:, None] & h_mask[None, :])
    tl.store(cnt_ptr + t64 * NB + nb, 0, mask=last)


@triton.jit
def moe_down_grouped(act_ptr, rw_ptr, ids_ptr, w_ptr, rows_ptr, counts_ptr, y_ptr, T, part_ptr, cnt_ptr,
                     H: tl.constexpr, F: tl.constexpr, KT: tl.constexpr, KTP: tl.constexpr, E: tl.constexpr,
                     BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NB: tl.constexpr, DOT_F32: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(T * KT, BLOCK_M) + tl.minimum(E, T * KT)
    group = pid // (GROUP_M * NB)
    first_m = group * GROUP_M
    group_size = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * NB)) % group_size
    nb = (pid % (GROUP_M * NB)) // group_size

    e, i0, count = _block_of(counts_ptr, pid_m, E, BLOCK_E, BLOCK_M)
    if e < E:
        i = i0 + tl.arange(0, BLOCK_M)
        ok = i < count
        toks = tl.load(rows_ptr + e.to(tl.int64) * T + i, mask=ok, other=0)
        a_rows = act_ptr + ((toks.to(tl.int64) * KT + _main_slot(ids_ptr, rw_ptr, toks, ok, e, KT)) * F)[:, None]
        offs_h = nb * BLOCK_H + tl.arange(0, BLOCK_H)
        # rows past H are clamped for loading; their sums are dropped at the store
        w_rows = w_ptr + e.to(tl.int64) * (H * F) + tl.minimum(offs_h, H - 1).to(tl.int64)[:, None] * F
        acc = tl.zeros([BLOCK_M, BLOCK_H], tl.float32)
        for k0 in range(0, F, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)[None, :]
            a = tl.load(_ptr(a_rows, k), mask=k < F, other=0.0)
            w = tl.load(_ptr(w_rows, k), mask=k < F, other=0.0)
            if DOT_F32:
                acc = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, tl.trans(w), acc)
        _down_finish(acc, toks, ok, e, offs_h, nb, ids_ptr, rw_ptr, y_ptr, part_ptr, cnt_ptr,
                     H, KT, KTP, NB, tl.bfloat16)


META = {
    "entry": "moe_down_grouped",
    "params": [["act_ptr", "*bf16", "in:0"], ["rw_ptr", "*fp32", "in:1"],
               ["ids_ptr", "*i32", "in:2"], ["w_ptr", "*bf16", "in:3"],
               ["rows_ptr", "*i32", "in:4"], ["counts_ptr", "*i32", "in:5"],
               ["y_ptr", "*bf16", "out:0"], ["T", "i32", "dim:T"],
               ["part_ptr", "*bf16", "scratch:partials"], ["cnt_ptr", "*i32", "scratch:counters"]],
    "constexprs": {"H": 2048, "F": 1408, "KT": 6, "KTP": 8, "E": 64,
                   "BLOCK_E": 64, "BLOCK_M": 128, "BLOCK_H": 128,
                   "BLOCK_K": 64, "GROUP_M": 8, "NB": 16, "DOT_F32": False},
    "grid": ["(cdiv(T * 6, 128) + min(64, T * 6)) * 16", 1, 1],
    "scratch": {"partials": "T * 24576", "counters": "T * 64"},
    "num_warps": 8,
    "num_stages": 4,
}
