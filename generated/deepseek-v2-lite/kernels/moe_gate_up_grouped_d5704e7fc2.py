# moe_gate_up (grouped): act[t, j, f] = bf16(silu(g) * u),  e = ids[t, j],
#   g = bf16(sum_k x[t, k] * w[e, f, k]),  u = bf16(sum_k x[t, k] * w[e, 1408 + f, k]),
#   silu(g) = g / (1 + exp(-g)) in fp32 (g and u rounded to bf16 as the unfused model stores them).
#   x [T, 2048] bf16, ids i32 [T, 6], w [64, 2816, 2048] bf16 (rows 0..1407 gate,
#   1408..2815 up), rows i32 [64, T] / counts i32 [64] (moe_align: the tokens of each
#   expert), act [T, 6, 1408] bf16; fp32 accumulate.
#
# Many tokens: every expert's tokens, cut in blocks of BLOCK_M, make the row blocks of one GEMM
# (expert 0's blocks first; a program finds its expert and block from a prefix sum over the
# 64 counts). One program per [BLOCK_M tokens, BLOCK_F gate columns + the matching up columns]
# tile: the token rows of x are gathered (each a contiguous 16-byte-aligned run), the expert's
# gate and up tiles stream through a K loop of BLOCK_K steps that the compiler software-pipelines
# over num_stages shared-memory buffers, two tensor-core dots per step share the A tile. Grid:
# cdiv(T * 6, 128) + min(64, T * 6) row blocks (a bound on the experts' blocks; programs past the last exit) times
# 11 column tiles, ordered in groups of GROUP_M row blocks per column sweep, so a group's
# x rows and the expert's weight tiles stay in L2. Each token's result depends on its own row only,
# so the order of the lists does not change a bit of it.
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
def _store_act(act_ptr, ids_ptr, a, toks, ok, e, offs_f, F: tl.constexpr, KT: tl.constexpr,
               KTP: tl.constexpr):
    """a [NT, BF]: expert e's activations of tokens toks (where ok), columns offs_f -> act[t, j, f]
    of every slot j of t that chose e: one store to the first such slot, and only where some row
    names e twice, a pass over the other slots (a token naming e twice gets the same row twice)."""
    t64 = toks.to(tl.int64)
    f_mask = offs_f < F
    idt, mine, first, again = _mine(ids_ptr, toks, ok, e, KT, KTP)
    tl.store(act_ptr + (t64 * KT + first)[:, None] * F + offs_f[None, :], a,
             mask=ok[:, None] & f_mask[None, :])
    if again:
        j = tl.arange(0, KTP)
        for jj in tl.static_range(1, KT):
            ej = tl.sum(tl.where(j[None, :] == jj, idt, 0), 1)
            more = ok & (ej == e) & (first < jj)
            tl.store(act_ptr + (t64 * KT + jj)[:, None] * F + offs_f[None, :], a,
                     mask=more[:, None] & f_mask[None, :])


@triton.jit
def _silu_mul(g, u):
    """act = bf16(silu(g) * u), g and u rounded to bf16 first (as the unfused model stores them)."""
    g = g.to(tl.bfloat16).to(tl.float32)
    u = u.to(tl.bfloat16).to(tl.float32)
    return (g / (1.0 + tl.exp(-g)) * u).to(tl.bfloat16)


@triton.jit
def moe_gate_up_grouped(x_ptr, ids_ptr, w_ptr, rows_ptr, counts_ptr, act_ptr, T,
                        H: tl.constexpr, F: tl.constexpr, KT: tl.constexpr, KTP: tl.constexpr, E: tl.constexpr,
                        BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr,
                        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, DOT_F32: tl.constexpr):
    # grouped ordering: GROUP_M row blocks walk the column tiles together
    pid = tl.program_id(0)
    num_m = tl.cdiv(T * KT, BLOCK_M) + tl.minimum(E, T * KT)
    num_f: tl.constexpr = (F + BLOCK_F - 1) // BLOCK_F
    group = pid // (GROUP_M * num_f)
    first_m = group * GROUP_M
    group_size = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_f)) % group_size
    pid_f = (pid % (GROUP_M * num_f)) // group_size

    e, i0, count = _block_of(counts_ptr, pid_m, E, BLOCK_E, BLOCK_M)
    if e < E:
        i = i0 + tl.arange(0, BLOCK_M)
        ok = i < count
        toks = tl.load(rows_ptr + e.to(tl.int64) * T + i, mask=ok, other=0)
        x_rows = x_ptr + toks.to(tl.int64)[:, None] * H
        offs_f = pid_f * BLOCK_F + tl.arange(0, BLOCK_F)
        # gate row f and up row F + f of expert e; rows past F are clamped for loading
        g_rows = w_ptr + e.to(tl.int64) * (2 * F * H) + tl.minimum(offs_f, F - 1).to(tl.int64)[:, None] * H
        u_rows = g_rows + F * H
        acc_g = tl.zeros([BLOCK_M, BLOCK_F], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_F], tl.float32)
        for k0 in range(0, H, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)[None, :]
            a = tl.load(_ptr(x_rows, k), mask=k < H, other=0.0)
            wg = tl.load(_ptr(g_rows, k), mask=k < H, other=0.0)
            wu = tl.load(_ptr(u_rows, k), mask=k < H, other=0.0)
            if DOT_F32:
                acc_g = tl.dot(a.to(tl.float32), tl.trans(wg.to(tl.float32)), acc_g, input_precision="ieee")
                acc_u = tl.dot(a.to(tl.float32), tl.trans(wu.to(tl.float32)), acc_u, input_precision="ieee")
            else:
                acc_g = tl.dot(a, tl.trans(wg), acc_g)
                acc_u = tl.dot(a, tl.trans(wu), acc_u)
        _store_act(act_ptr, ids_ptr, _silu_mul(acc_g, acc_u), toks, ok, e, offs_f, F, KT, KTP)


META = {
    "entry": "moe_gate_up_grouped",
    "params": [["x_ptr", "*bf16", "in:0"], ["ids_ptr", "*i32", "in:1"],
               ["w_ptr", "*bf16", "in:2"], ["rows_ptr", "*i32", "in:3"],
               ["counts_ptr", "*i32", "in:4"], ["act_ptr", "*bf16", "out:0"],
               ["T", "i32", "dim:T"]],
    "constexprs": {"H": 2048, "F": 1408, "KT": 6, "KTP": 8, "E": 64, "BLOCK_E": 64,
                   "BLOCK_M": 128, "BLOCK_F": 128, "BLOCK_K": 64,
                   "GROUP_M": 8, "DOT_F32": False},
    "grid": ["(cdiv(T * 6, 128) + min(64, T * 6)) * 11", 1, 1],
    "num_warps": 8,
    "num_stages": 3,
}
