
   # gemv: y[t, n] = sum_k x[t, k] * w[n, k]  for t < T
#   x [T, 16384] bf16, w [7168, 16384] f8e4m3, y [T, 7168] bf16; fp32 accumulate.
# Quantized W (triton/_quant.j2): f8e4m3 codes, scales per 128 rows x 128 columns,
#   activations dynamic_group (groups of 128): w = (value - zero) * scale dequantized in registers
#   from one byte an element (the bytes streamed are the speedup). The CUDA-core path multiplies in
#   fp32; the tensor-core path dots the e4m3 codes of W and of the quantized A tile, scaled per tile by a_scale[t] * w_scale[n].
#   FMA_BLOCK_K = 256 and BLOCK_K = 128 are multiples of act_group = 128 (a tile quantizes whole groups).
#
# Memory-bound: W is streamed once, in [BLOCK_N, *] tiles of 16-byte vector loads (evict_first, so
# the small activations stay in L2). Grid (cdiv(T, BLOCK_T), N blocks, splits):
#  * T <= FMA_ROWS = 1: CUDA-core path, N blocks of BLOCK_N rows (small: many programs, short
#    GEMVs fill the GPU). Each program keeps one fp32 [BLOCK_N, FMA_BLOCK_K] partial product per
#    row and reduces it once at the end (no per-iteration shuffles); the row's A chunk is loaded
#    once as a vector and broadcast over the W tile's layout.
#  * otherwise: tensor-core path, N blocks of BLOCK_N_DOT rows (large: the A-operand work per W
#    byte, e.g. the SwiGLU or RMSNorm prologue, shrinks as BLOCK_T / BLOCK_N_DOT); programs past
#    the last block exit at once. Swap-AB: acc[n, t] += W_tile[BLOCK_N_DOT, BLOCK_K] @ A_tile^T,
#    so W is the MMA's M side and up to BLOCK_T rows share every W tile, software-pipelined over
#    num_stages buffers; row blocks of one W tile are adjacent in launch order, so the re-reads
#    for T > BLOCK_T mostly hit L2.
#  * split-K (SPLIT): program z of Z sums one K range into its own fp32 scratch slot; the last
#    program to arrive at a tile (a counter per tile) adds the Z slots in order z = 0 .. Z-1 and
#    writes the output (deterministic: no arrival-order float adds), leaving the counter zero.
#  * a programmatic dependent launch (triton/_pdl.j2): it may start while the kernel before it
#    drains, and waits for it before reading anything.
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _halves(x):
    """[R, S, 2C] -> its even and odd columns, [R, S, C] each (a thread's own registers): the FFMA
    chains' column split (_lanes_fma here, _fp8_fma.j2's _run_sums)."""
    return tl.split(tl.reshape(x, [x.shape[0], x.shape[1], x.shape[2] // 2, 2]))


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
def _row_start(r, mask):
    """Element offset of each row's first element in the A operand: r [R] -> int64 [R]."""
    return r.to(tl.int64) * 16384


@triton.jit
def _a_tile(a_ptr, as_ptr, row_off, k, mask):
    """A operand a[row, k] as bf16 (and, for lm_head_last, s^2 as fp32; with the prologue, h from
    x and d and the row's inv):
    row_off [R, 1] and k [1, BK] -> [R, BK], or row_off [1] and k [BK] -> [BK]."""
    # ready codes: code * its group's scale, the value the activation quantizer leaves (fp32)
    c = tl.load(a_ptr + row_off + k, mask=mask, other=0.0).to(tl.float32)
    g = row_off // 16384 * 128 + k // 128
    return c * tl.load(as_ptr + g, mask=mask, other=0.0)


@triton.jit
def _w_raw(w_rows, k0, k_end, BK: tl.constexpr):
    """The stored codes of W[rows, k0 : k0 + BK], zero past k_end: w_rows [BN, 1] row pointers
    (16384 bytes a row), k0 a multiple of BK -> f8e4m3 [BN, BK]."""
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
    """t[srow, g(k)] (w_scale or w_zero: 128 groups a row) over the tile's columns
    k0 .. k0 + BK: srow [BN, 1] the W rows' scale rows -> [BN, 1] (the tile in one group),
    [BN, BK / 128] (one a group of the tile) or [BN, BK] (a group per column)."""
    if 128 % BK == 0:
        return tl.load(t_ptr + srow * 128 + tl.minimum(k0 // 128, 127))
    elif BK % 128 == 0:
        g = tl.minimum(k0 // 128 + tl.arange(0, BK // 128), 127)[None, :]
        return tl.load(t_ptr + srow * 128 + g)
    else:
        k = k0 + tl.arange(0, BK)[None, :]
        return tl.load(t_ptr + srow * 128 + tl.minimum(k // 128, 127))


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
def _fp8_tile(w3, k0, k_end, FK: tl.constexpr, MASKED: tl.constexpr):
    """W's e4m3 codes of columns k0 .. k0 + FK as [BN, FK / 16, 16] (run s, byte b: column
    k0 + 16 s + b); w3 [BN, 1, 1] the rows' first bytes; a zero code at k_end and past. MASKED
    False: the step lies inside k_end (K a multiple of FK: ranges are whole steps), and the
    loads need no mask (no registers zeroed for it: CS2R, 1/8 an instruction a weight)."""
    kk = k0 + 16 * tl.arange(0, FK // 16)[None, :, None] + tl.arange(0, 16)[None, None, :]
    p = w3 + kk
    p = tl.multiple_of(p, [1, 1, 16])
    if MASKED:
        return tl.load(p, mask=kk < k_end, other=0.0, eviction_policy="evict_first")
    else:
        return tl.load(p, eviction_policy="evict_first")


@triton.jit
def _fp8_run_scales(w_scale_ptr, srow3, a_scales, k0, k_lo, k_end, FK: tl.constexpr, BK: tl.constexpr):
    """w_scale[n, g] * a_scale[g] for each run of 16 columns of the K step from k0 (g: the run's
    group): [BN, FK / 16, 1]; srow3 [BN, 1, 1] the rows' scale rows; a_scales from the range's
    first column k_lo, one a BK-column group; 0 past k_end (those runs' codes are zero too)."""
    # (the indices as quotients: no run of contiguous scales for the compiler to vectorize, so
    # the loads keep the code tile's thread order and need no layout conversion)
    kc2 = k0 + 16 * tl.arange(0, FK // 16)[:, None]       # [runs, 1]: A's scales as A's codes (a slice of the tile's layout)
    kc = kc2[None, :, :]
    ws = tl.load(w_scale_ptr + srow3 * 128 + tl.minimum(kc // 128, 127))
    a_s = tl.load(a_scales + (kc2 - k_lo) // BK, mask=kc2 < k_end, other=0.0)[None, :, :]
    return ws * a_s


@triton.jit
def _run_sums(w, a):
    """sum_b w[n, s, b] * a[0, s, b] over a run's 16 columns -> [R, S, 1], as one chain of 16 FFMAs
    a run (tl.sum's tree took a multiply and an add for half the products: 1.6 instructions a
    product against 1). The columns taken apart by four rounds of halves (gemv.py.j2's _halves),
    in the same order for both operands."""
    w1_0, w1_1 = _halves(w)
    a1_0, a1_1 = _halves(a)
    w2_0, w2_1 = _halves(w1_0)
    a2_0, a2_1 = _halves(a1_0)
    w2_2, w2_3 = _halves(w1_1)
    a2_2, a2_3 = _halves(a1_1)
    w3_0, w3_1 = _halves(w2_0)
    a3_0, a3_1 = _halves(a2_0)
    w3_2, w3_3 = _halves(w2_1)
    a3_2, a3_3 = _halves(a2_1)
    w3_4, w3_5 = _halves(w2_2)
    a3_4, a3_5 = _halves(a2_2)
    w3_6, w3_7 = _halves(w2_3)
    a3_6, a3_7 = _halves(a2_3)
    w4_0, w4_1 = _halves(w3_0)
    a4_0, a4_1 = _halves(a3_0)
    w4_2, w4_3 = _halves(w3_1)
    a4_2, a4_3 = _halves(a3_1)
    w4_4, w4_5 = _halves(w3_2)
    a4_4, a4_5 = _halves(a3_2)
    w4_6, w4_7 = _halves(w3_3)
    a4_6, a4_7 = _halves(a3_3)
    w4_8, w4_9 = _halves(w3_4)
    a4_8, a4_9 = _halves(a3_4)
    w4_10, w4_11 = _halves(w3_5)
    a4_10, a4_11 = _halves(a3_5)
    w4_12, w4_13 = _halves(w3_6)
    a4_12, a4_13 = _halves(a3_6)
    w4_14, w4_15 = _halves(w3_7)
    a4_14, a4_15 = _halves(a3_7)
    s = w4_0 * a4_0
    s = s + w4_1 * a4_1
    s = s + w4_2 * a4_2
    s = s + w4_3 * a4_3
    s = s + w4_4 * a4_4
    s = s + w4_5 * a4_5
    s = s + w4_6 * a4_6
    s = s + w4_7 * a4_7
    s = s + w4_8 * a4_8
    s = s + w4_9 * a4_9
    s = s + w4_10 * a4_10
    s = s + w4_11 * a4_11
    s = s + w4_12 * a4_12
    s = s + w4_13 * a4_13
    s = s + w4_14 * a4_14
    s = s + w4_15 * a4_15
    return s

@triton.jit
def _finish(y_ptr, part_ptr, cnt_ptr, acc, offs, mask, tile, SPLIT: tl.constexpr, SLOT: tl.constexpr,
            ZMAX: tl.constexpr):
    """Write an fp32 output tile. Under split-K each program parks its partial sums in its own
    scratch slot (z * SLOT elements in) and the last program to arrive at the tile (a counter per
    tile) adds the slots in split order: a fixed order, so two identical launches give identical
    bits (atomic accumulation would add in arrival order). It leaves the counter zero."""
    if SPLIT:
        nz = tl.num_programs(2)
        if nz > 1:
            # scratch is untyped bytes (the interpreter hands int32, and has no f32 xchg): the
            # partials travel as int32 bits, ordered by the counter's acq_rel below
            bits_ptr = part_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
            # through L2 atomics
            tl.atomic_xchg(bits_ptr + tl.program_id(2) * SLOT + offs, acc.to(tl.int32, bitcast=True),
                           mask=mask, sem="relaxed")
            tl.debug_barrier()   # every thread's partials are issued before the release below
            arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
            if arrived == nz - 1:
                tl.debug_barrier()   # the whole program reads after the acquire above
                total = tl.zeros_like(acc)
                for z in tl.static_range(ZMAX):   # unrolled: the slot loads are in flight together
                    live = mask & (tl.full(offs.shape, z, tl.int32) < nz)
                    got = tl.load(bits_ptr + z * SLOT + offs, mask=live, other=0, cache_modifier=".cg")
                    total += got.to(tl.float32, bitcast=True)
                tl.store(y_ptr + offs, total.to(y_ptr.dtype.element_ty), mask=mask)
                tl.store(cnt_ptr + tile, 0)
        else:
            tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def gemv(a_ptr, w_ptr, w_scale_ptr, as_ptr, y_ptr, M, part_ptr, cnt_ptr,
        N: tl.constexpr, K: tl.constexpr, BLOCK_N: tl.constexpr, FMA_BLOCK_K: tl.constexpr,
        FMA_T: tl.constexpr, FMA_ROWS: tl.constexpr, BLOCK_N_DOT: tl.constexpr, BLOCK_K: tl.constexpr,
        BLOCK_T: tl.constexpr, KU: tl.constexpr, SPLIT: tl.constexpr, SLOT: tl.constexpr,
        ZMAX: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    # this program's K range, whole KU units so both paths' tiles stay aligned
    k_chunk = tl.cdiv(tl.cdiv(K, tl.num_programs(2)), KU) * KU
    k_lo = pid_s * k_chunk
    k_hi = tl.minimum(K, k_lo + k_chunk)
    tile = pid_t * tl.num_programs(1) + pid_n
    if M <= FMA_ROWS:
        # ---- CUDA-core path: rows 0 .. M-1 (M <= FMA_ROWS <= FMA_T), one W tile per step ----
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        # out-of-range rows re-read row N-1 (unmasked, vectorized loads); results are dropped
        w_rows = w_ptr + tl.minimum(offs_n, N - 1).to(tl.int64)[:, None] * 16384
        srow = (tl.minimum(offs_n, N - 1) // 128)[:, None]
        w3 = w_rows[:, :, None]
        # the first K step's codes (before the wait where PRELOAD: weights are immutable), masked
        # always: a split past K (K's steps fewer than the splits' whole steps) has an empty range
        w_first = _fp8_tile(w3, k_lo, k_hi, FMA_BLOCK_K, True)
        if PDL:
            gdc_wait()   # earlier kernels' writes are visible from here on
        # ready codes: the row's (row 0's: a narrow step has one) from column k_lo, its group scales
        a_codes = a_ptr + k_lo
        a_scales = as_ptr + k_lo // BLOCK_K
        runs2 = tl.arange(0, FMA_BLOCK_K // 16)[:, None]
        b2 = tl.arange(0, 16)[None, :]
        srow3 = srow[:, :, None]
        acc = tl.zeros([BLOCK_N, FMA_BLOCK_K // 16, 1], tl.float32)
        # the first K step on the tile read before the wait (its range has one: ranges are whole
        # K steps, K > 0), the rest loaded at the top of their step. Not a loop-carried next tile:
        # a tile carried through the loop is 16 bytes a register no more (a byte a register, and
        # a PRMT a byte to unpack and repack it: 6.5 instructions a weight on sm_90)
        # A's codes as [runs, 16], broadcast over the rows: a slice of the code tile's layout, so each
        # thread loads and converts its own columns once (a 3-D load of [1, runs, 16] took a layout
        # of its own and a conversion through shared memory a K step)
        ka = k_lo + 16 * runs2 + b2
        a = tl.load(a_codes + (ka - k_lo), mask=ka < k_hi, other=0.0).to(tl.float32)[None, :, :]
        run = _run_sums(w_first.to(tl.float32), tl.broadcast_to(a, w_first.shape))    # exact products, fp32 sums
        acc += run * _fp8_run_scales(w_scale_ptr, srow3, a_scales, k_lo, k_lo, k_hi, FMA_BLOCK_K, BLOCK_K)

        for k0 in range(k_lo + FMA_BLOCK_K, k_hi, FMA_BLOCK_K):
            w = _fp8_tile(w3, k0, k_hi, FMA_BLOCK_K, False)
            # A's codes as [runs, 16], broadcast over the rows: a slice of the code tile's layout, so each
            # thread loads and converts its own columns once (a 3-D load of [1, runs, 16] took a layout
            # of its own and a conversion through shared memory a K step)
            ka = k0 + 16 * runs2 + b2
            a = tl.load(a_codes + (ka - k_lo), mask=ka < k_hi, other=0.0).to(tl.float32)[None, :, :]
            run = _run_sums(w.to(tl.float32), tl.broadcast_to(a, w.shape))    # exact products, fp32 sums
            acc += run * _fp8_run_scales(w_scale_ptr, srow3, a_scales, k0, k_lo, k_hi, FMA_BLOCK_K, BLOCK_K)

        rows = tl.arange(0, 1)
        out = tl.sum(tl.sum(acc, axis=2), axis=1)[None, :]
        offs_f = rows.to(tl.int64)[:, None] * N + offs_n[None, :]
        _finish(y_ptr, part_ptr, cnt_ptr, out, offs_f, (rows[:, None] < M) & n_mask[None, :], tile, SPLIT, SLOT, ZMAX)


META = {
    "entry": "gemv",
    "params": [["a_ptr", "*fp8e4nv", "in:0"], ["w_ptr", "*fp8e4nv", "in:1"], ["w_scale_ptr", "*fp32", "in:2"], ["as_ptr", "*fp32", "in:3"], ["y_ptr", "*bf16", "out:0"], ["M", "i32", "dim:T"], ["part_ptr", "*fp32", "scratch:partials"], ["cnt_ptr", "*i32", "scratch:counters"]],
    "constexprs": {"N": 7168, "K": 16384, "BLOCK_N": 64, "FMA_BLOCK_K": 256,
                   "FMA_T": 1, "FMA_ROWS": 1, "BLOCK_N_DOT": 64, "BLOCK_K": 128,
                   "BLOCK_T": 32, "KU": 256, "SPLIT": True, "SLOT": 7168,
                   "ZMAX": 3,
                   "DOT_F32": False, "PDL": True},
    "pdl": True,
    "reads_before_wait": ["w_ptr"],
    "grid": ["cdiv(T, 32)", 112, "1 + 2 * max(0, min(1, 2 - T))"],
    "scratch": {"partials": "3 * 28672",
                "counters": "min(cdiv(T, 32), 1) * 448"},
    "num_warps": 4,
    "num_stages": 4,
}
