# moe_down: y[t, h] = bf16(sum_j r[t, j] * sum_f act[t, j, f] * w[e, h, f]),  e = ids[t, j]
#   act [T, 8, 512] bf16, r f32 [T, 8], ids i32 [T, 8], w [32, 1024, 512] bf16,
#   y [T, 1024] bf16; fp32 sums, one rounding.
#
# Decode: grid (min(32, T * 8) distinct-expert slots, 16 blocks of BLOCK_H = 64 output
# rows): program (u, b) takes the u-th smallest chosen expert e and the tokens that chose it, and
# streams e's row block once for all of them (moe_gate_up.py.j2's two paths: CUDA cores for at
# most FMA_T = 1 tokens, else swap-AB tensor-core tiles of BLOCK_T tokens); the A operand
# of token t is act[t, j] for the slot j that chose e (of largest weight if several did: the
# others weigh 0: ids not made by moe_route). Slots of id -1 name no expert.
# Combine, deterministic: each program parks r[t, j] * (its sums) in an fp32 scratch [B, 8, 1024]
# for every slot j of t that chose e and counts itself in at the tile (t, b); the program that
# completes the token's distinct experts adds the token's 8 partials in slot order and writes
# y[t] (the same bits whatever order the experts finish in), leaving the counter zero.
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _ptr(base, offs):
    """base + offs, with the 16-byte alignment of each contiguous run of 8 bf16 made known to the
    compiler (rows are multiples of 8 elements and buffers 16-byte aligned), for vector loads."""
    p = base + offs
    if len(p.shape) == 1:
        p = tl.multiple_of(p, [16])
    else:
        p = tl.multiple_of(p, [1, 16])
    return p


@triton.jit
def _expert_of(ids_ptr, u, P, BLOCK_E: tl.constexpr, PC: tl.constexpr):
    """The u-th smallest expert id among the P = T * KT chosen slots, and how many slots chose it
    (0 when fewer than u + 1 distinct experts were chosen): a histogram of the ids (-1, no
    expert, left out), then a scan."""
    ex = tl.arange(0, BLOCK_E)
    hist = tl.zeros([BLOCK_E], tl.int32)
    for p0 in range(0, P, PC):
        p = p0 + tl.arange(0, PC)
        ids = tl.load(ids_ptr + p, mask=p < P, other=-1)
        hist += tl.histogram(ids, BLOCK_E, mask=(p < P) & (ids >= 0))
    present = (hist > 0).to(tl.int32)
    sel = (present > 0) & (tl.cumsum(present, 0) == u + 1)
    return tl.sum(tl.where(sel, ex, 0), 0), tl.sum(tl.where(sel, hist, 0), 0)


@triton.jit
def _tokens_of(ids_ptr, e, T, start, KT: tl.constexpr, KTP: tl.constexpr, TC: tl.constexpr,
               NT: tl.constexpr):
    """The tokens that chose expert e, in token order, ranks start .. start + NT - 1: token ids [NT]
    (0 where missing), which are present [NT], and how many tokens chose e in all. Scans the ids
    in chunks of TC tokens; a chunk's hits are ranked by a prefix sum."""
    i = tl.arange(0, NT)
    j = tl.arange(0, KTP)
    toks = tl.zeros([NT], tl.int32)
    found = tl.zeros([NT], tl.int32)
    seen = tl.sum(tl.zeros([TC], tl.int32), 0)
    for t0 in range(0, T, TC):
        t = t0 + tl.arange(0, TC)
        idt = tl.load(ids_ptr + t[:, None] * KT + j[None, :], mask=(t[:, None] < T) & (j[None, :] < KT),
                      other=-1)
        hit = tl.max((idt == e).to(tl.int32), 1)
        rank = tl.cumsum(hit, 0) - 1 + seen - start
        m = (hit > 0)[None, :] & (rank[None, :] == i[:, None])
        toks += tl.sum(tl.where(m, t[None, :], 0), 1)
        found += tl.sum(m.to(tl.int32), 1)
        seen += tl.sum(hit, 0)
    return toks, found > 0, seen


@triton.jit
def _mine(ids_ptr, toks, ok, e, KT: tl.constexpr, KTP: tl.constexpr):
    """Token rows' ids [NT, KTP] (-1 past KT or where not ok), which slots name expert e, the first
    of them and whether any row names e more than once (moe_route's ids never do; ids made
    otherwise may, with the extra slots weighing 0)."""
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
    an expert in several slots only where its ids were not moe_route's; the extra slots weigh 0
    and add nothing whichever row they are given."""
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
    experts arrive in; slots of id -1 have none), writes y[t] and leaves the counter zero."""
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
        experts += (ok & (seen == 0) & (ej >= 0)).to(tl.int32)
    tl.debug_barrier()   # every thread's partials are issued before the release below
    arrived = tl.atomic_add(cnt_ptr + t64 * NB + nb, 1, mask=ok, sem="acq_rel")
    last = ok & (arrived == experts - 1)
    tl.debug_barrier()   # the whole program reads after the acquire above
    total = tl.zeros_like(acc)
    for jj in range(KT):     # a loop, not unrolled: one slot's tile in registers at a time
        # a slot of id -1 (no expert on this rank) has no partial: its scratch is stale
        named = last & (tl.load(ids_ptr + t64 * KT + jj, mask=last, other=-1) >= 0)
        got = tl.load(pp + (t64 * KT + jj)[:, None] * H + offs_h[None, :],
                      mask=named[:, None] & h_mask[None, :], other=0.0, cache_modifier=".cg")
        total += got.to(tl.float32)
    tl.store(y_ptr + t64[:, None] * H + offs_h[None, :], total.to(y_ptr.dtype.element_ty),
             mask=last[:, None] & h_mask[None, :])
    tl.store(cnt_ptr + t64 * NB + nb, 0, mask=last)


@triton.jit
def moe_down(act_ptr, rw_ptr, ids_ptr, w_ptr, y_ptr, T, part_ptr, cnt_ptr,
             H: tl.constexpr, F: tl.constexpr, KT: tl.constexpr, KTP: tl.constexpr,
             BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, FMA_BLOCK_K: tl.constexpr,
             FMA_T: tl.constexpr, FMA_TP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr,
             PC: tl.constexpr, TC: tl.constexpr, NB: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
    if PDL:
        gdc_wait()   # earlier kernels' writes are visible from here on
    u = tl.program_id(0)
    nb = tl.program_id(1)
    e, slots = _expert_of(ids_ptr, u, T * KT, BLOCK_E, PC)
    if slots > 0:
        offs_h = nb * BLOCK_H + tl.arange(0, BLOCK_H)
        # rows past H are clamped for loading (unmasked, vectorized); their sums are dropped
        w_rows = w_ptr + e.to(tl.int64) * (H * F) + tl.minimum(offs_h, H - 1).to(tl.int64)[:, None] * F
        toks, ok, n = _tokens_of(ids_ptr, e, T, 0, KT, KTP, TC, FMA_TP)
        if n <= FMA_T:
            # ---- CUDA-core path: tokens r < n, one W tile per step ----
            rows = tl.arange(0, FMA_TP)
            a_off = (toks.to(tl.int64) * KT + _main_slot(ids_ptr, rw_ptr, toks, ok, e, KT)) * F
            ok0 = tl.sum(tl.where((rows == 0) & ok, 1, 0), 0, keep_dims=True) > 0   # [1]
            a0_row = act_ptr + tl.sum(tl.where(rows == 0, a_off, 0), 0)
            acc0 = tl.zeros([BLOCK_H, FMA_BLOCK_K], tl.float32)
            for k0 in range(0, F, FMA_BLOCK_K):
                k = k0 + tl.arange(0, FMA_BLOCK_K)
                w = tl.load(_ptr(w_rows, k[None, :]), mask=k[None, :] < F, other=0.0,
                            eviction_policy="evict_first").to(tl.float32)
                a0 = tl.load(_ptr(a0_row, k), mask=ok0 & (k < F), other=0.0).to(tl.float32)
                acc0 += w * a0[None, :]
            out = tl.zeros([FMA_TP, BLOCK_H], tl.float32)
            out = tl.where(rows[:, None] == 0, tl.sum(acc0, axis=1)[None, :], out)
            _down_finish(out, toks, ok, e, offs_h, nb, ids_ptr, rw_ptr, y_ptr, part_ptr, cnt_ptr,
                         H, KT, KTP, NB, tl.float32)
        else:
            # ---- tensor-core path: BLOCK_T tokens at a time, acc[h, t] = W @ A^T ----
            for s in range(0, n, BLOCK_T):
                toks_t, ok_t, _ = _tokens_of(ids_ptr, e, T, s, KT, KTP, TC, BLOCK_T)
                a_rows = act_ptr + ((toks_t.to(tl.int64) * KT + _main_slot(ids_ptr, rw_ptr, toks_t, ok_t, e, KT)) * F)[:, None]
                acc = tl.zeros([BLOCK_H, BLOCK_T], tl.float32)
                for k0 in range(0, F, BLOCK_K):
                    k = k0 + tl.arange(0, BLOCK_K)[None, :]
                    a = tl.load(_ptr(a_rows, k), mask=ok_t[:, None] & (k < F), other=0.0)
                    w = tl.load(_ptr(w_rows, k), mask=k < F, other=0.0, eviction_policy="evict_first")
                    if DOT_F32:
                        acc = tl.dot(w.to(tl.float32), tl.trans(a.to(tl.float32)), acc, input_precision="ieee")
                    else:
                        acc = tl.dot(w, tl.trans(a), acc)
                _down_finish(tl.trans(acc), toks_t, ok_t, e, offs_h, nb, ids_ptr, rw_ptr, y_ptr, part_ptr,
                             cnt_ptr, H, KT, KTP, NB, tl.float32)


META = {
    "entry": "moe_down",
    "params": [["act_ptr", "*bf16", "in:0"], ["rw_ptr", "*fp32", "in:1"],
               ["ids_ptr", "*i32", "in:2"], ["w_ptr", "*bf16", "in:3"],
               ["y_ptr", "*bf16", "out:0"], ["T", "i32", "dim:T"],
               ["part_ptr", "*fp32", "scratch:partials"], ["cnt_ptr", "*i32", "scratch:counters"]],
    "constexprs": {"H": 1024, "F": 512, "KT": 8, "KTP": 8, "BLOCK_E": 32,
                   "BLOCK_H": 64, "FMA_BLOCK_K": 128, "FMA_T": 1,
                   "FMA_TP": 1, "BLOCK_K": 64, "BLOCK_T": 16,
                   "PC": 256, "TC": 32, "NB": 16, "DOT_F32": False, "PDL": True},
    "pdl": True,
    "grid": ["min(32, T * 8)", 16, 1],
    "scratch": {"partials": "B * 32768", "counters": "B * 64"},
    "num_warps": 8,
    "num_stages": 4,
}
