# moe_gate_up (grouped): act[t, j, f] = bf16(silu(g) * u),  e = ids[t, j],
#   g = bf16(sum_k x[t, k] * w[e, f, k]),  u = bf16(sum_k x[t, k] * w[e, 2048 + f, k]),
#   silu(g) = g / (1 + exp(-g)) in fp32 (g and u rounded to bf16 as the unfused model stores them).
#   x [T, 7168] bf16, ids i32 [T, 8], w [384, 4096, 7168] bf16 (rows 0..2047 gate,
#   2048..4095 up), rows i32 [384, T] / counts i32 [384] (moe_align: the tokens of each
#   expert), act [T, 8, 2048] bf16; fp32 accumulate.
#
# Grouped GEMM over the tokens sorted by expert (vLLM's and SGLang's fused_moe): every expert's
# token list, cut in blocks of BLOCK_M = 128, makes the row blocks of one GEMM (expert 0's blocks
# first; a program finds its expert and block from a prefix sum over the 384 counts, so an expert
# with no tokens has no block and a partial last block is masked). One program per [BLOCK_M tokens,
# BLOCK_F = 128 gate columns + the matching up columns] tile: the token rows of x are gathered
# (each a contiguous 16-byte-aligned run), the expert's gate and up rows stream through a K loop
# of BLOCK_K = 128 steps (unmasked: 128 divides 7168) that the compiler software-pipelines over num_stages
# shared-memory buffers (cp.async + async wgmma on sm_90); one dot per step over the interleaved
# gate/up rows. Grid: cdiv(T * 8, 128) + min(384, T * 8)
# row blocks (a bound on the experts' blocks; programs past the last exit) times 16 column
# tiles, in groups of GROUP_M = 8 row blocks per column sweep. An expert's last block of at most
# 64 tokens runs a 64-row tile (a second copy of the tile in the kernel). Each token's
# result depends on its own row only, so the order of the lists does not change a bit of it.
# Quantized experts: f8e4m3 codes, scales per 128 rows x 128 columns (1792 an
#   expert, expert e's from e * 1792 on), each weight tile dequantized in registers; x quantized dynamic_group (groups of 128: K tiles hold whole groups);
#   the tiles dotted in bf16.
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
    """The gathered x rows' columns k, quantized dynamic_group (the dot's A operand)."""
    if EVEN_K:
        a = tl.load(_ptr(x_rows, k))
    else:
        a = tl.load(_ptr(x_rows, k), mask=k < 7168, other=0.0)
    return _a_quant(a)


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
def _w_raw(w_rows, k0, k_end, BK: tl.constexpr):
    """The stored codes of W[rows, k0 : k0 + BK], zero past k_end: w_rows [BN, 1] row pointers
    (7168 bytes a row), k0 a multiple of BK -> f8e4m3 [BN, BK]."""
    k = k0 + tl.arange(0, BK)[None, :]
    p = w_rows + k
    p = tl.multiple_of(p, [1, 16])
    return tl.load(p, mask=k < k_end, other=0.0, eviction_policy="evict_first")


@triton.jit
def _w_values(raw):
    """The codes' values (fp32) in K order: [BN, BK]."""
    return raw.to(tl.float32)


@triton.jit
def _w_group(t_ptr, srow, k0, k_end, BK: tl.constexpr):
    """t[srow, g(k)] (w_scale or w_zero: 56 groups a row) over the tile's columns
    k0 .. k0 + BK: srow [BN, 1] the W rows' scale rows -> [BN, 1] (the tile in one group),
    [BN, BK / 128] (one a group of the tile) or [BN, BK] (a group per column)."""
    if 128 % BK == 0:
        return tl.load(t_ptr + srow * 56 + tl.minimum(k0 // 128, 55))
    elif BK % 128 == 0:
        g = tl.minimum(k0 // 128 + tl.arange(0, BK // 128), 55)[None, :]
        return tl.load(t_ptr + srow * 56 + g)
    else:
        k = k0 + tl.arange(0, BK)[None, :]
        return tl.load(t_ptr + srow * 56 + tl.minimum(k // 128, 55))


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
        # a scale (and zero) per group of the tile's 128 columns: the tile seen as [BN, groups, 128]
        v = tl.reshape(v, [v.shape[0], s.shape[1], 128])
        w = tl.reshape(v * s[:, :, None], [v.shape[0], BK])
    return w


@triton.jit
def _w_deq(raw, srow, w_scale_ptr, k0, k_end, BK: tl.constexpr):
    """W[rows, k0 : k0 + BK] in fp32 from the raw tile (_w_raw), zero past k_end."""
    w = _w_deq_unmasked(raw, srow, w_scale_ptr, k0, k_end, BK)
    k = k0 + tl.arange(0, BK)[None, :]
    return tl.where(k < k_end, w, 0.0)


@triton.jit
def _a_scale(amax):
    """An activation group's scale: amax / 448, 1 where the group is all zeros."""
    return tl.where(amax > 0, tl.math.div_rn(amax, 448.0), 1.0)


@triton.jit
def _a_quant(a):
    """The A tile, [BK] or [R, BK], as the dynamic_group activation quantizer leaves it: e4m3(x / s) * s in
    fp32."""
    x = a.to(tl.float32)
    # each group's amax by a masked reduction in a's own layout (a reshape to [.., groups, act_group]
    # costs the CUDA-core path its registers: 255 and spills on sm_90)
    col = tl.arange(0, x.shape[len(x.shape) - 1]) // 128
    s = tl.zeros_like(x)
    for g in tl.static_range(x.shape[len(x.shape) - 1] // 128):
        amax = tl.max(tl.where(col == g, tl.abs(x), 0.0), axis=len(x.shape) - 1, keep_dims=True)
        s = tl.where(col == g, _a_scale(amax), s)
    return tl.math.div_rn(x, s).to(tl.float8e4nv).to(tl.float32) * s


@triton.jit
def _a_codes(a):
    """(e4m3 codes [R, BK], scales [R]) of an A tile holding one activation group a row."""
    x = a.to(tl.float32)
    s = _a_scale(tl.max(tl.abs(x), axis=1))
    return tl.math.div_rn(x, s[:, None]).to(tl.float8e4nv), s


@triton.jit
def _a_ready(code_rows, scale_rows, k0, k, mask, BK: tl.constexpr):
    """A[rows, k] in fp32 from ready codes: code_rows / scale_rows the rows' first code and scale
    ([R, 1] pointers with k [1, BK], or one row's with k [BK]), k = k0 + 0 .. BK - 1 (k0 a multiple
    of BK); zero where masked. A tile inside one group loads one scale a row (a scale an element
    would be staged in shared memory beside the codes: 4x their bytes)."""
    c = tl.load(code_rows + k, mask=mask, other=0.0).to(tl.float32)
    if 128 % BK == 0:
        s = tl.load(scale_rows + k0 // 128)
    else:
        s = tl.load(scale_rows + tl.minimum(k // 128, 55), mask=mask, other=0.0)
    return tl.where(mask, c * s, 0.0)


@triton.jit
def _gate_up_tile(x_ptr, ids_ptr, w_ptr, rows_ptr, act_ptr, T, e, i0, count, pid_f, w_scale_ptr, as_ptr,
                  H: tl.constexpr, F: tl.constexpr, KT: tl.constexpr, KTP: tl.constexpr, BM: tl.constexpr,
                  BLOCK_F: tl.constexpr, BLOCK_K: tl.constexpr, PAIR: tl.constexpr, EVEN_K: tl.constexpr,
                  DOT_F32: tl.constexpr):
    """The [BM tokens of expert e from list index i0, BLOCK_F gate + up columns] tile."""
    i = i0 + tl.arange(0, BM)
    ok = i < count
    toks = tl.load(rows_ptr + e.to(tl.int64) * T + i, mask=ok, other=0)
    x_rows = x_ptr + toks.to(tl.int64)[:, None] * H
    s_rows = as_ptr + toks.to(tl.int64)[:, None] * 56
    w_e = w_ptr + e.to(tl.int64) * 29360128
    ws = w_scale_ptr + e.to(tl.int64) * 1792   # expert e's scales

    offs_f = pid_f * BLOCK_F + tl.arange(0, BLOCK_F)
    if PAIR:
        # weight tile row r: gate row f (r even) or up row F + f (r odd), f = pid_f * BLOCK_F + r // 2
        r = tl.arange(0, 2 * BLOCK_F)
        fr = tl.minimum(pid_f * BLOCK_F + r // 2, F - 1)      # rows past F clamped for loading
        w_row = (fr + (r % 2) * F).to(tl.int64)[:, None]
        w_rows = w_e + w_row * 7168
        srow = w_row // 128
        acc = tl.zeros([BM, 2 * BLOCK_F], tl.float32)
        for k0 in range(0, H, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)[None, :]
            a = _a_ready(x_rows, s_rows, k0, k, k < H, BLOCK_K)
            w = _w_deq(_w_raw(w_rows, k0, H, BLOCK_K), srow, ws, k0, H, BLOCK_K)
            acc = _dot(a.to(tl.bfloat16), w.to(tl.bfloat16), acc, DOT_F32)
        acc_g, acc_u = tl.split(tl.reshape(acc, [BM, BLOCK_F, 2]))
    else:
        # gate row f and up row F + f of expert e; rows past F are clamped for loading
        f_rows = tl.minimum(offs_f, F - 1).to(tl.int64)[:, None]
        g_rows = w_e + f_rows * 7168
        u_rows = g_rows + 14680064
        srow_g = f_rows // 128
        srow_u = (f_rows + F) // 128
        acc_g = tl.zeros([BM, BLOCK_F], tl.float32)
        acc_u = tl.zeros([BM, BLOCK_F], tl.float32)
        for k0 in range(0, H, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)[None, :]
            a = _a_ready(x_rows, s_rows, k0, k, k < H, BLOCK_K)
            wg = _w_deq(_w_raw(g_rows, k0, H, BLOCK_K), srow_g, ws, k0, H, BLOCK_K)
            wu = _w_deq(_w_raw(u_rows, k0, H, BLOCK_K), srow_u, ws, k0, H, BLOCK_K)
            a, wg, wu = a.to(tl.bfloat16), wg.to(tl.bfloat16), wu.to(tl.bfloat16)
            acc_g = _dot(a, wg, acc_g, DOT_F32)
            acc_u = _dot(a, wu, acc_u, DOT_F32)
    idt = _slot_ids(ids_ptr, toks, ok, KT, KTP)
    _store_act(act_ptr, _silu_mul(acc_g, acc_u), toks, ok, idt, e, offs_f, F, KT, KTP)


@triton.jit
def moe_gate_up_grouped(x_ptr, ids_ptr, w_ptr, rows_ptr, counts_ptr, act_ptr, T, w_scale_ptr, as_ptr,
                        H: tl.constexpr, F: tl.constexpr, KT: tl.constexpr, KTP: tl.constexpr, E: tl.constexpr,
                        BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr,
                        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NF: tl.constexpr, PAIR: tl.constexpr,
                        HALF_TAIL: tl.constexpr, EVEN_K: tl.constexpr, DOT_F32: tl.constexpr):
    pid_m, pid_f = _tile(tl.program_id(0), tl.cdiv(T * KT, BLOCK_M) + tl.minimum(E, T * KT), NF, GROUP_M)
    e, i0, count = _block_of(counts_ptr, pid_m, E, BLOCK_E, BLOCK_M)
    if e < E:
        if HALF_TAIL:
            if count - i0 <= BLOCK_M // 2:
                _gate_up_tile(x_ptr, ids_ptr, w_ptr, rows_ptr, act_ptr, T, e, i0, count, pid_f, w_scale_ptr, as_ptr, H, F, KT,
                              KTP, BLOCK_M // 2, BLOCK_F, BLOCK_K, PAIR, EVEN_K, DOT_F32)
            else:
                _gate_up_tile(x_ptr, ids_ptr, w_ptr, rows_ptr, act_ptr, T, e, i0, count, pid_f, w_scale_ptr, as_ptr, H, F, KT,
                              KTP, BLOCK_M, BLOCK_F, BLOCK_K, PAIR, EVEN_K, DOT_F32)
        else:
            _gate_up_tile(x_ptr, ids_ptr, w_ptr, rows_ptr, act_ptr, T, e, i0, count, pid_f, w_scale_ptr, as_ptr, H, F, KT, KTP,
                          BLOCK_M, BLOCK_F, BLOCK_K, PAIR, EVEN_K, DOT_F32)


META = {
    "entry": "moe_gate_up_grouped",
    "params": [["x_ptr", "*fp8e4nv", "in:0"], ["ids_ptr", "*i32", "in:1"],
               ["w_ptr", "*fp8e4nv", "in:2"], ["rows_ptr", "*i32", "in:3"],
               ["counts_ptr", "*i32", "in:4"], ["act_ptr", "*bf16", "out:0"],
               ["T", "i32", "dim:T"], ["w_scale_ptr", "*fp32", "in:5"], ["as_ptr", "*fp32", "in:6"]],
    "constexprs": {"H": 7168, "F": 2048, "KT": 8, "KTP": 8, "E": 384, "BLOCK_E": 512,
                   "BLOCK_M": 128, "BLOCK_F": 128, "BLOCK_K": 128,
                   "GROUP_M": 8, "NF": 16, "PAIR": 1, "HALF_TAIL": 1,
                   "EVEN_K": True,
                   "DOT_F32": False},
    "grid": ["(cdiv(T * 8, 128) + min(384, T * 8)) * 16", 1, 1],
    "num_warps": 8,
    "num_stages": 3,
}
