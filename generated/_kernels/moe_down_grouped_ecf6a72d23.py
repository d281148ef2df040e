# moe_down (grouped): y[t, h] = bf16(sum_j bf16(r[t, j] * sum_f act[t, j, f] * w[e, h, f])),  e = ids[t, j]
#   act [T, 1, 8192] bf16, r f32 [T, 1], ids i32 [T, 1], w [16, 5120, 8192] bf16,
#   rows i32 [16, T] / counts i32 [16] (moe_align: the tokens of each expert), y [T, 5120] bf16;
#   fp32 sums; each slot's weighted sum is rounded to bf16 once, then the slots are added in fp32
#   in slot order j = 0 .. 0.
#
# Grouped GEMM (moe_gate_up_grouped.py.j2's row blocks: BLOCK_M = 128 tokens of one expert, their act
# rows gathered: token t's act[t, j] for the slot j that chose e, of largest weight if several
# did) times 20 column tiles of BLOCK_H = 256 output features, a K loop of BLOCK_K = 64 over
# F = 8192 (unmasked), software-pipelined over num_stages buffers; GROUP_M = 8 ordering.
# An expert's last block of at most 64 tokens runs a 64-row tile (a second copy of the tile).
# Epilogue and combine, deterministic without float atomics: the routing weight multiplies the
# fp32 tile, each (token, slot) row is parked once as bf16 in a scratch [T, 1, 5120], and the
# program counts itself in at each token's tile (t, column tile) with an acq_rel atomic; the
# program that completes a token's distinct experts adds its 1 partials in slot order and writes
# y[t] (the same bits whatever order the experts finish in), leaving the counter zero. Those
# rows are compacted COMBINE_ROWS = 16 at a time, so a chunk's 1 partial tiles are loaded together
# (one memory round trip per chunk, not one per slot).
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
def _tile(pid, num_m, NUM_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Program pid -> (row block, column tile), GROUP_M row blocks per sweep of the NUM_N column
    tiles: a group's rows (one or two experts' tokens) and its experts' weight tiles stay in L2."""
    group = pid // (GROUP_M * NUM_N)
    first_m = group * GROUP_M
    size = tl.minimum(num_m - first_m, GROUP_M)
    r = pid % (GROUP_M * NUM_N)
    return first_m + r % size, r // size


@triton.jit
def _block_of(counts_ptr, pid_m, E: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr):
    """Row block pid_m of the experts' token lists cut in BLOCK_M blocks (expert 0's blocks first):
    (expert, first list index of the block, tokens of the expert); expert == E past the last block
    (the grid is a bound on the blocks: those programs exit)."""
    ex = tl.arange(0, BLOCK_E)
    cnt = tl.load(counts_ptr + ex, mask=ex < E, other=0)
    nblk = (cnt + BLOCK_M - 1) // BLOCK_M
    end = tl.cumsum(nblk, 0)
    e = tl.sum((end <= pid_m).to(tl.int32), 0)
    sel = ex == e
    first = tl.sum(tl.where(sel, end - nblk, 0), 0)
    return e, (pid_m - first) * BLOCK_M, tl.sum(tl.where(sel, cnt, 0), 0)


@triton.jit
def _slot_ids(ids_ptr, toks, ok, KT: tl.constexpr, KTP: tl.constexpr):
    """The block's token rows of ids, [BLOCK_M, KTP] in one vector load (-1 past KT and in the
    rows that are not ok)."""
    j = tl.arange(0, KTP)
    return tl.load(ids_ptr + toks.to(tl.int64)[:, None] * KT + j[None, :],
                   mask=ok[:, None] & (j[None, :] < KT), other=-1)


@triton.jit
def _col(m, jj, KTP: tl.constexpr):
    """Column jj of a [BLOCK_M, KTP] tile (a reduction within the row: no data leaves the row)."""
    j = tl.arange(0, KTP)
    return tl.sum(tl.where(j[None, :] == jj, m, tl.zeros_like(m)), 1)


@triton.jit
def _slot_rw(rw_ptr, toks, ok, KT: tl.constexpr, KTP: tl.constexpr):
    """The block's token rows of the routing weights, [BLOCK_M, KTP] (0 past KT and where not ok)."""
    j = tl.arange(0, KTP)
    return tl.load(rw_ptr + toks.to(tl.int64)[:, None] * KT + j[None, :],
                   mask=ok[:, None] & (j[None, :] < KT), other=0.0)


@triton.jit
def _main_slot(idt, rwt, ok, e, KTP: tl.constexpr):
    """For each token row that chose expert e, the slot whose act row the down projection reads:
    the one of largest routing weight among the slots naming e (the first on ties); 0 in the rows
    that are not ok. A token names an expert in several slots only where its ids were not
    moe_route's; the extra slots weigh 0 and add nothing whichever row they are given."""
    j = tl.arange(0, KTP)
    mine = idt == e
    best = tl.max(tl.where(mine, rwt, -1.0), 1)
    main = tl.min(tl.where(mine & (rwt == best[:, None]), j[None, :], KTP), 1)
    return tl.where(ok & (main < KTP), main, 0)


@triton.jit
def _park(pp, acc, toks, ok, idt, rwt, e, offs_h, H: tl.constexpr, KT: tl.constexpr,
          KTP: tl.constexpr):
    """Park bf16(r[t, j] * acc) as the partial of every slot j of token t that names e: one store
    to the first such slot and, only where a row names e twice, a pass over the other slots (their
    own weights). Returns how many distinct experts each row's token chose (its partials' writers)."""
    j = tl.arange(0, KTP)
    t64 = toks.to(tl.int64)
    h_mask = offs_h < H
    mine = idt == e
    first = tl.min(tl.where(mine, j[None, :], KTP), 1)
    r = tl.where(ok, 1.0, 0.0)
    tl.store(pp + (t64 * KT + first)[:, None] * H + offs_h[None, :], (acc * r[:, None]).to(tl.bfloat16),
             mask=ok[:, None] & h_mask[None, :])
    if tl.max(tl.sum(mine.to(tl.int32), 1), 0) > 1:
        for jj in tl.static_range(1, KT):
            more = ok & (_col(idt, jj, KTP) == e) & (first < jj)
            rj = tl.where(more, 1.0, 0.0)
            tl.store(pp + (t64 * KT + jj)[:, None] * H + offs_h[None, :],
                     (acc * rj[:, None]).to(tl.bfloat16), mask=more[:, None] & h_mask[None, :])
    # the token's distinct experts: slots that no earlier slot of the token repeats
    n = tl.zeros_like(toks)
    for jj in tl.static_range(KT):
        ej = _col(idt, jj, KTP)
        seen = tl.max(((j[None, :] < jj) & (idt == ej[:, None])).to(tl.int32), 1)
        n += (ok & (seen == 0) & (ej >= 0)).to(tl.int32)
    return n


@triton.jit
def _combine(pp, y_ptr, cnt_ptr, ids_ptr, toks, last, offs_h, nb, H: tl.constexpr, KT: tl.constexpr,
             NB: tl.constexpr, CR: tl.constexpr, BLOCK_H: tl.constexpr):
    """For the rows whose token this program completed (last): y[t] = bf16(sum over j = 0 .. KT-1
    of the parked partials, in fp32, in slot order: the same bits whichever expert came last; a
    slot of id -1, no expert on this rank, has none: its scratch is stale and is not read), and
    the tile's counter back to 0. The last rows are compacted CR at a time (on average BLOCK_M /
    KT of them, all of them in the last experts' blocks), so the KT partial tiles of a chunk are
    loaded together, unrolled: one memory round trip per CR rows instead of KT per block."""
    lv = last.to(tl.int32)
    n_last = tl.sum(lv, 0)
    pos = tl.cumsum(lv, 0) - 1
    c = tl.arange(0, CR)
    h_mask = offs_h < H
    for c0 in range(0, n_last, CR):
        sel = (lv[None, :] > 0) & (pos[None, :] == (c0 + c)[:, None])     # [CR, BLOCK_M]
        live = tl.max(sel.to(tl.int32), 1) > 0
        tk = tl.sum(tl.where(sel, toks[None, :], 0), 1).to(tl.int64)
        m2 = live[:, None] & h_mask[None, :]
        total = tl.zeros([CR, BLOCK_H], tl.float32)
        for jj in tl.static_range(KT):
            named = tl.load(ids_ptr + tk * KT + jj, mask=live, other=-1) >= 0
            total += tl.load(pp + (tk * KT + jj)[:, None] * H + offs_h[None, :],
                             mask=m2 & named[:, None], other=0.0, cache_modifier=".cg").to(tl.float32)
        tl.store(y_ptr + tk[:, None] * H + offs_h[None, :], total.to(y_ptr.dtype.element_ty), mask=m2)
        tl.store(cnt_ptr + tk * NB + nb, 0, mask=live)


@triton.jit
def _down_tile(act_ptr, rw_ptr, ids_ptr, w_ptr, rows_ptr, y_ptr, T, pp, cnt_ptr, e, i0, count, nb,
               H: tl.constexpr, F: tl.constexpr, KT: tl.constexpr, KTP: tl.constexpr, BM: tl.constexpr,
               BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, NB: tl.constexpr, CR: tl.constexpr,
               EVEN_K: tl.constexpr, DOT_F32: tl.constexpr):
    """The [BM tokens of expert e from list index i0, BLOCK_H output features] tile, its partials
    parked, counted in, and the tokens it completes combined."""
    i = i0 + tl.arange(0, BM)
    ok = i < count
    toks = tl.load(rows_ptr + e.to(tl.int64) * T + i, mask=ok, other=0)
    t64 = toks.to(tl.int64)
    a_rows = act_ptr + ((t64 * KT + _main_slot(_slot_ids(ids_ptr, toks, ok, KT, KTP),
                                               _slot_rw(rw_ptr, toks, ok, KT, KTP), ok, e, KTP)) * F)[:, None]
    offs_h = nb * BLOCK_H + tl.arange(0, BLOCK_H)
    # rows past H are clamped for loading; their sums are dropped at the stores
    w_rows = w_ptr + e.to(tl.int64) * (H * F) + tl.minimum(offs_h, H - 1).to(tl.int64)[:, None] * F
    acc = tl.zeros([BM, BLOCK_H], tl.float32)
    for k0 in range(0, F, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)[None, :]
        if EVEN_K:
            a = tl.load(_ptr(a_rows, k))
            w = tl.load(_ptr(w_rows, k))
        else:
            a = tl.load(_ptr(a_rows, k), mask=k < F, other=0.0)
            w = tl.load(_ptr(w_rows, k), mask=k < F, other=0.0)
        if DOT_F32:
            acc = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(w), acc)
    # the slots' ids and weights again (L2 hits) rather than held in registers over the K loop
    experts = _park(pp, acc, toks, ok, _slot_ids(ids_ptr, toks, ok, KT, KTP),
                    _slot_rw(rw_ptr, toks, ok, KT, KTP), e, offs_h, H, KT, KTP)
    tl.debug_barrier()   # every thread's partials are issued before the release below
    arrived = tl.atomic_add(cnt_ptr + t64 * NB + nb, 1, mask=ok, sem="acq_rel")
    last = ok & (arrived == experts - 1)
    tl.debug_barrier()   # the whole program reads after the acquires above
    _combine(pp, y_ptr, cnt_ptr, ids_ptr, toks, last, offs_h, nb, H, KT, NB, CR, BLOCK_H)


@triton.jit
def moe_down_grouped(act_ptr, rw_ptr, ids_ptr, w_ptr, rows_ptr, counts_ptr, y_ptr, T, part_ptr, cnt_ptr,
                     H: tl.constexpr, F: tl.constexpr, KT: tl.constexpr, KTP: tl.constexpr, E: tl.constexpr,
                     BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NB: tl.constexpr, CR: tl.constexpr,
                     HALF_TAIL: tl.constexpr, EVEN_K: tl.constexpr, DOT_F32: tl.constexpr):
    pid_m, nb = _tile(tl.program_id(0), tl.cdiv(T * KT, BLOCK_M) + tl.minimum(E, T * KT), NB, GROUP_M)
    e, i0, count = _block_of(counts_ptr, pid_m, E, BLOCK_E, BLOCK_M)
    # the scratch is untyped memory (the interpreter harness hands it over as int32): bf16 here
    pp = part_ptr.to(tl.pointer_type(tl.bfloat16), bitcast=True)
    if e < E:
        if HALF_TAIL:
            if count - i0 <= BLOCK_M // 2:
                _down_tile(act_ptr, rw_ptr, ids_ptr, w_ptr, rows_ptr, y_ptr, T, pp, cnt_ptr, e, i0, count, nb,
                           H, F, KT, KTP, BLOCK_M // 2, BLOCK_H, BLOCK_K, NB, CR, EVEN_K, DOT_F32)
            else:
                _down_tile(act_ptr, rw_ptr, ids_ptr, w_ptr, rows_ptr, y_ptr, T, pp, cnt_ptr, e, i0, count, nb,
                           H, F, KT, KTP, BLOCK_M, BLOCK_H, BLOCK_K, NB, CR, EVEN_K, DOT_F32)
        else:
            _down_tile(act_ptr, rw_ptr, ids_ptr, w_ptr, rows_ptr, y_ptr, T, pp, cnt_ptr, e, i0, count, nb,
                       H, F, KT, KTP, BLOCK_M, BLOCK_H, BLOCK_K, NB, CR, EVEN_K, DOT_F32)


META = {
    "entry": "moe_down_grouped",
    "params": [["act_ptr", "*bf16", "in:0"], ["rw_ptr", "*fp32", "in:1"],
               ["ids_ptr", "*i32", "in:2"], ["w_ptr", "*bf16", "in:3"],
               ["rows_ptr", "*i32", "in:4"], ["counts_ptr", "*i32", "in:5"],
               ["y_ptr", "*bf16", "out:0"], ["T", "i32", "dim:T"],
               ["part_ptr", "*bf16", "scratch:partials"], ["cnt_ptr", "*i32", "scratch:counters"]],
    "constexprs": {"H": 5120, "F": 8192, "KT": 1, "KTP": 1, "E": 16,
                   "BLOCK_E": 16, "BLOCK_M": 128, "BLOCK_H": 256,
                   "BLOCK_K": 64, "GROUP_M": 8, "NB": 20, "CR": 16,
                   "HALF_TAIL": 1, "EVEN_K": True, "DOT_F32": False},
    "grid": ["(cdiv(T * 1, 128) + min(16, T * 1)) * 20", 1, 1],
    "scratch": {"partials": "T * 10240", "counters": "T * 80"},
    "num_warps": 8,
    "num_stages": 3,
}
