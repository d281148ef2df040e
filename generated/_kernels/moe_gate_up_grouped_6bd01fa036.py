# moe_gate_up (grouped): act[t, j, f] = bf16(silu(g) * u),  e = ids[t, j],
#   g = bf16(sum_k x[t, k] * w[e, f, k]),  u = bf16(sum_k x[t, k] * w[e, 2880 + f, k]),
#   silu(g) = g / (1 + exp(-g)) in fp32 (g and u rounded to bf16 as the unfused model stores them).
#   x [T, 2880] bf16, ids i32 [T, 4], w [32, 5760, 2880] bf16 (rows 0..2879 gate,
#   2880..5759 up), rows i32 [32, T] / counts i32 [32] (moe_align: the tokens of each
#   expert), act [T, 4, 2880] bf16; fp32 accumulate.
#
# Grouped GEMM over the tokens sorted by expert (vLLM's and SGLang's fused_moe): every expert's
# token list, cut in blocks of BLOCK_M = 128, makes the row blocks of one GEMM (expert 0's blocks
# first; a program finds its expert and block from a prefix sum over the 32 counts, so an expert
# with no tokens has no block and a partial last block is masked). One program per [BLOCK_M tokens,
# BLOCK_F = 128 gate columns + the matching up columns] tile: the token rows of x are gathered
# (each a contiguous 16-byte-aligned run), the expert's gate and up rows stream through a K loop
# of BLOCK_K = 64 steps (unmasked: 64 divides 2880) that the compiler software-pipelines over num_stages
# shared-memory buffers (cp.async + async wgmma on sm_90); one dot per step over the interleaved
# gate/up rows. Grid: cdiv(T * 4, 128) + min(32, T * 4)
# row blocks (a bound on the experts' blocks; programs past the last exit) times 23 column
# tiles, in groups of GROUP_M = 8 row blocks per column sweep. An expert's last block of at most
# 64 tokens runs a 64-row tile (a second copy of the tile in the kernel). Each token's
# result depends on its own row only, so the order of the lists does not change a bit of it.
# Expert bias b [32, 5760] (gate | up, like w's rows) added to g and u before the activation.
# The activation is clamped_swiglu (alpha 1.702, limit 7.0), not silu(g) * u.
# MXFP4 experts: e2m1 codes, a power-of-two scale per row and 32 columns (518400 an expert, stored
#   as the float 2^(b - 127)). Swap-AB, the codes the dot's lhs (upcast in registers, Hopper's wgmma
#   takes A from registers): each K step
#   accT[n, m] += sum_k value(code[n, k]) * 2^(b[n, k // 32] - 127) * x[m, k]   (tl.dot_scaled with
#   x^T in bf16, fp32 sums; W exactly), the tile transposed once after the K loop.
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
def _dot(a, w, acc, DOT_F32: tl.constexpr):
    """acc + a @ w^T (the interpreter's bf16 dot is wrong: it runs the fp32 one)."""
    if DOT_F32:
        return tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
    return tl.dot(a, tl.trans(w), acc)


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
def _x_tile(x_rows, k, EVEN_K: tl.constexpr):
    """The gathered x rows' columns k, bf16 (the dot's A operand)."""
    if EVEN_K:
        a = tl.load(_ptr(x_rows, k))
    else:
        a = tl.load(_ptr(x_rows, k), mask=k < 2880, other=0.0)
    return a


@triton.jit
def _silu_mul(g, u):
    """act = bf16(silu(g) * u), g and u rounded to bf16 first (as the unfused model stores them)."""
    g = g.to(tl.bfloat16).to(tl.float32)
    u = u.to(tl.bfloat16).to(tl.float32)
    return (g / (1.0 + tl.exp(-g)) * u).to(tl.bfloat16)


@triton.jit
def _store_act(act_ptr, a, toks, ok, idt, e, offs_f, F: tl.constexpr, KT: tl.constexpr,
               KTP: tl.constexpr):
    """a [BLOCK_M, BF]: expert e's activations of tokens toks (where ok), columns offs_f ->
    act[t, j, f] for every slot j of t that names e: one store to the first such slot and, only
    where a row names e twice (ids not made by moe_route, the extra slots weighing 0), a pass
    over the other slots (such a token gets the same row in each)."""
    j = tl.arange(0, KTP)
    mine = idt == e
    first = tl.min(tl.where(mine, j[None, :], KTP), 1)
    t64 = toks.to(tl.int64)
    f_mask = offs_f < F
    tl.store(act_ptr + (t64 * KT + first)[:, None] * F + offs_f[None, :], a,
             mask=ok[:, None] & f_mask[None, :])
    if tl.max(tl.sum(mine.to(tl.int32), 1), 0) > 1:
        for jj in tl.static_range(1, KT):
            more = ok & (_col(idt, jj, KTP) == e) & (first < jj)
            tl.store(act_ptr + (t64 * KT + jj)[:, None] * F + offs_f[None, :], a,
                     mask=more[:, None] & f_mask[None, :])


@triton.jit
def _gated_act(g, u):
    """act = bf16((u' + 1) g' sigmoid(alpha g')), g' = min(g, limit), u' = clamp(u, -limit, limit)
    (GPT-OSS's experts: alpha 1.702, limit 7.0); g and u rounded to bf16 first, as
    the unfused model stores them."""
    g = tl.minimum(g.to(tl.bfloat16).to(tl.float32), 7.0)
    u = tl.minimum(tl.maximum(u.to(tl.bfloat16).to(tl.float32), -7.0), 7.0)
    return ((u + 1.0) * g / (1.0 + tl.exp(-1.702 * g))).to(tl.bfloat16)


@triton.jit
def _w_raw(w_rows, k0, k_end, BK: tl.constexpr):
    """The stored codes of W[rows, k0 : k0 + BK], zero past k_end: w_rows [BN, 1] row pointers
    (1440 bytes a row), k0 a multiple of BK -> bytes [BN, BK / 2], two codes each."""
    j = k0 // 2 + tl.arange(0, BK // 2)[None, :]
    p = w_rows + j
    p = tl.multiple_of(p, [1, 16])
    # byte j holds codes 2j and 2j + 1: the mask is j < ceil(k_end / 2), written on j itself so the
    # compiler sees it constant over runs of bytes (2 * j < k_end hid that: byte-wide loads, and the
    # tensor-core paths lost their cp.async pipelining)
    return tl.load(p, mask=j < (k_end + 1) // 2, other=0, eviction_policy="evict_first")


@triton.jit
def _w_values(raw):
    """The codes' values (fp32) in K order: [BN, BK]."""
    c = tl.reshape(tl.join(raw & 15, raw >> 4), [raw.shape[0], raw.shape[1] * 2]).to(tl.int32)
    m = (c & 1).to(tl.float32)
    e = (c >> 1) & 3
    mag = tl.where(e == 0, 0.5 * m, (1 << e).to(tl.float32) * (0.5 + 0.25 * m))
    return tl.where((c & 8) != 0, -mag, mag)


@triton.jit
def _w_group(t_ptr, srow, k0, k_end, BK: tl.constexpr):
    """t[srow, g(k)] (w_scale or w_zero: 90 groups a row) over the tile's columns
    k0 .. k0 + BK: srow [BN, 1] the W rows' scale rows -> [BN, 1] (the tile in one group),
    [BN, BK / 32] (one a group of the tile) or [BN, BK] (a group per column)."""
    if 32 % BK == 0:
        return tl.load(t_ptr + srow * 90 + tl.minimum(k0 // 32, 89))
    elif BK % 32 == 0:
        g = tl.minimum(k0 // 32 + tl.arange(0, BK // 32), 89)[None, :]
        return tl.load(t_ptr + srow * 90 + g)
    else:
        k = k0 + tl.arange(0, BK)[None, :]
        return tl.load(t_ptr + srow * 90 + tl.minimum(k // 32, 89))


@triton.jit
def _w_deq_unmasked(raw, srow, w_scale_ptr, k0, k_end, BK: tl.constexpr):
    """W[rows, k0 : k0 + BK] in fp32 from the raw tile (_w_raw); past k_end whatever the zero codes
    give ((0 - zero) * scale for integers): for a caller whose A is zero there."""
    v = _w_values(raw)
    s = _w_group(w_scale_ptr, srow, k0, k_end, BK)
    z = 0.0
    if s.shape[1] == 1 or s.shape[1] == BK:
        w = v * s
    else:
        # a scale (and zero) per group of the tile's 32 columns: the tile seen as [BN, groups, 32]
        v = tl.reshape(v, [v.shape[0], s.shape[1], 32])
        w = tl.reshape(v * s[:, :, None], [v.shape[0], BK])
    return w


@triton.jit
def _w_deq(raw, srow, w_scale_ptr, k0, k_end, BK: tl.constexpr):
    """W[rows, k0 : k0 + BK] in fp32 from the raw tile (_w_raw), zero past k_end."""
    w = _w_deq_unmasked(raw, srow, w_scale_ptr, k0, k_end, BK)
    k = k0 + tl.arange(0, BK)[None, :]
    return tl.where(k < k_end, w, 0.0)


@triton.jit
def _w_e8m0(t_ptr, srow, k0, BK: tl.constexpr):
    """The e8m0 bytes of w_scale[srow, g] for the tile's BK / 32 groups from k0 -> u8 [BN, BK / 32]:
    the plan stores an MX scale as the float 2^(b - 127), whose exponent field is b (b = 0's
    2^-127 a subnormal with field 0). Groups past the row's 90 read 127 (1.0): their codes
    are zero, and a NaN scale would make 0 * scale NaN."""
    g = k0 // 32 + tl.arange(0, BK // 32)[None, :]
    s = tl.load(t_ptr + srow * 90 + g, mask=g < 90, other=1.0)
    return ((s.to(tl.int32, bitcast=True) >> 23) & 255).to(tl.uint8)


@triton.jit
def _gate_up_tile(x_ptr, ids_ptr, w_ptr, rows_ptr, act_ptr, T, e, i0, count, pid_f, b_ptr, w_scale_ptr,
                  H: tl.constexpr, F: tl.constexpr, KT: tl.constexpr, KTP: tl.constexpr, BM: tl.constexpr,
                  BLOCK_F: tl.constexpr, BLOCK_K: tl.constexpr, PAIR: tl.constexpr, EVEN_K: tl.constexpr,
                  DOT_F32: tl.constexpr):
    """The [BM tokens of expert e from list index i0, BLOCK_F gate + up columns] tile."""
    i = i0 + tl.arange(0, BM)
    ok = i < count
    toks = tl.load(rows_ptr + e.to(tl.int64) * T + i, mask=ok, other=0)
    x_rows = x_ptr + toks.to(tl.int64)[:, None] * H
    w_e = w_ptr + e.to(tl.int64) * 8294400
    ws = w_scale_ptr + e.to(tl.int64) * 518400   # expert e's scales

    offs_f = pid_f * BLOCK_F + tl.arange(0, BLOCK_F)
    if PAIR:
        # weight tile row r: gate row f (r even) or up row F + f (r odd), f = pid_f * BLOCK_F + r // 2
        r = tl.arange(0, 2 * BLOCK_F)
        fr = tl.minimum(pid_f * BLOCK_F + r // 2, F - 1)      # rows past F clamped for loading
        w_row = (fr + (r % 2) * F).to(tl.int64)[:, None]
        w_rows = w_e + w_row * 1440
        srow = w_row // 1
        acc_t = tl.zeros([2 * BLOCK_F, BM], tl.float32)
        for k0 in range(0, H, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)[None, :]
            a = _x_tile(x_rows, k, EVEN_K).to(tl.bfloat16)
            acc_t = tl.dot_scaled(_w_raw(w_rows, k0, H, BLOCK_K), _w_e8m0(ws, srow, k0, BLOCK_K), "e2m1",
                                  tl.trans(a), None, "bf16", acc_t)
        acc = tl.trans(acc_t)
        acc_g, acc_u = tl.split(tl.reshape(acc, [BM, BLOCK_F, 2]))
    else:
        # gate row f and up row F + f of expert e; rows past F are clamped for loading
        f_rows = tl.minimum(offs_f, F - 1).to(tl.int64)[:, None]
        g_rows = w_e + f_rows * 1440
        u_rows = g_rows + 4147200
        srow_g = f_rows // 1
        srow_u = (f_rows + F) // 1
        acc_gt = tl.zeros([BLOCK_F, BM], tl.float32)
        acc_ut = tl.zeros([BLOCK_F, BM], tl.float32)
        for k0 in range(0, H, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)[None, :]
            a_t = tl.trans(_x_tile(x_rows, k, EVEN_K).to(tl.bfloat16))
            acc_gt = tl.dot_scaled(_w_raw(g_rows, k0, H, BLOCK_K), _w_e8m0(ws, srow_g, k0, BLOCK_K), "e2m1",
                                   a_t, None, "bf16", acc_gt)
            acc_ut = tl.dot_scaled(_w_raw(u_rows, k0, H, BLOCK_K), _w_e8m0(ws, srow_u, k0, BLOCK_K), "e2m1",
                                   a_t, None, "bf16", acc_ut)
        acc_g, acc_u = tl.trans(acc_gt), tl.trans(acc_ut)
    idt = _slot_ids(ids_ptr, toks, ok, KT, KTP)
    b_m = offs_f < F
    acc_g += tl.load(b_ptr + e.to(tl.int64) * (2 * F) + offs_f, mask=b_m, other=0.0).to(tl.float32)[None, :]
    acc_u += tl.load(b_ptr + e.to(tl.int64) * (2 * F) + F + offs_f, mask=b_m, other=0.0).to(tl.float32)[None, :]
    _store_act(act_ptr, _gated_act(acc_g, acc_u), toks, ok, idt, e, offs_f, F, KT, KTP)


@triton.jit
def moe_gate_up_grouped(x_ptr, ids_ptr, w_ptr, rows_ptr, counts_ptr, act_ptr, T, b_ptr, w_scale_ptr,
                        H: tl.constexpr, F: tl.constexpr, KT: tl.constexpr, KTP: tl.constexpr, E: tl.constexpr,
                        BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr,
                        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NF: tl.constexpr, PAIR: tl.constexpr,
                        HALF_TAIL: tl.constexpr, EVEN_K: tl.constexpr, DOT_F32: tl.constexpr):
    pid_m, pid_f = _tile(tl.program_id(0), tl.cdiv(T * KT, BLOCK_M) + tl.minimum(E, T * KT), NF, GROUP_M)
    e, i0, count = _block_of(counts_ptr, pid_m, E, BLOCK_E, BLOCK_M)
    if e < E:
        if HALF_TAIL:
            if count - i0 <= BLOCK_M // 2:
                _gate_up_tile(x_ptr, ids_ptr, w_ptr, rows_ptr, act_ptr, T, e, i0, count, pid_f, b_ptr, w_scale_ptr, H, F, KT,
                              KTP, BLOCK_M // 2, BLOCK_F, BLOCK_K, PAIR, EVEN_K, DOT_F32)
            else:
                _gate_up_tile(x_ptr, ids_ptr, w_ptr, rows_ptr, act_ptr, T, e, i0, count, pid_f, b_ptr, w_scale_ptr, H, F, KT,
                              KTP, BLOCK_M, BLOCK_F, BLOCK_K, PAIR, EVEN_K, DOT_F32)
        else:
            _gate_up_tile(x_ptr, ids_ptr, w_ptr, rows_ptr, act_ptr, T, e, i0, count, pid_f, b_ptr, w_scale_ptr, H, F, KT, KTP,
                          BLOCK_M, BLOCK_F, BLOCK_K, PAIR, EVEN_K, DOT_F32)


META = {
    "entry": "moe_gate_up_grouped",
    "params": [["x_ptr", "*bf16", "in:0"], ["ids_ptr", "*i32", "in:1"],
               ["w_ptr", "*u8", "in:2"], ["rows_ptr", "*i32", "in:3"],
               ["counts_ptr", "*i32", "in:4"], ["act_ptr", "*bf16", "out:0"],
               ["T", "i32", "dim:T"], ["b_ptr", "*bf16", "in:5"], ["w_scale_ptr", "*fp32", "in:6"]],
    "constexprs": {"H": 2880, "F": 2880, "KT": 4, "KTP": 4, "E": 32, "BLOCK_E": 32,
                   "BLOCK_M": 128, "BLOCK_F": 128, "BLOCK_K": 64,
                   "GROUP_M": 8, "NF": 23, "PAIR": 1, "HALF_TAIL": 1,
                   "EVEN_K": True,
                   "DOT_F32": False},
    "grid": ["(cdiv(T * 4, 128) + min(32, T * 4)) * 23", 1, 1],
    "num_warps": 8,
    "num_stages": 3,
}
