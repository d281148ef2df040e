
   # lm_head_last: logits[b, v] = rstd_b * sum_k h[b, k] * w[v, k]  for b < B, in fp32, where
#   r = last_rows[b],  s = bf16(x[r] + d[r]),  h[b, k] = bf16(s[k] * norm[k]),
#   rstd_b = 1 / sqrt(mean_k(s^2) + eps)  (= rms_norm(s) @ w^T; the scale is applied to the fp32
#   sums, so sum_k s^2 accumulates in the same K loop and no pass over the row precedes it).
#   x [T, 2048] bf16, norm [2048], w [128256, 2048] bf16, logits f32 [B, 128256].
#
# Memory-bound: W is streamed once, in [BLOCK_N, *] tiles of 16-byte vector loads (evict_first, so
# the small activations stay in L2). Grid (cdiv(B, BLOCK_T), N blocks, splits):
#  * B <= FMA_ROWS = 1: CUDA-core path, N blocks of BLOCK_N rows (small: many programs, short
#    GEMVs fill the GPU). Each program keeps one fp32 [BLOCK_N, FMA_BLOCK_K] partial product per
#    row and reduces it once at the end (no per-iteration shuffles); the row's A chunk is loaded
#    once as a vector and broadcast over the W tile's layout.
#  * otherwise: tensor-core path, N blocks of BLOCK_N_DOT rows (large: the A-operand work per W
#    byte, e.g. the SwiGLU or RMSNorm prologue, shrinks as BLOCK_T / BLOCK_N_DOT); programs past
#    the last block exit at once. Swap-AB: acc[n, t] += W_tile[BLOCK_N_DOT, BLOCK_K] @ A_tile^T,
#    so W is the MMA's M side and up to BLOCK_T rows share every W tile, software-pipelined over
#    num_stages buffers; row blocks of one W tile are adjacent in launch order, so the re-reads
#    for B > BLOCK_T mostly hit L2.
#  * split-K (SPLIT): program z of Z sums one K range into its own fp32 scratch slot; the last
#    program to arrive at a tile (a counter per tile) adds the Z slots in order z = 0 .. Z-1 and
#    writes the output (deterministic: no arrival-order float adds), leaving the counter zero.
#  * a programmatic dependent launch (triton/_pdl.j2): it may start while the kernel before it
#    drains, and waits for it before reading anything.
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
def _row_start(rows_ptr, r, mask):
    """Element offset of each row's first element in the A operand: r [R] -> int64 [R]."""
    return tl.load(rows_ptr + r, mask=mask, other=0).to(tl.int64) * 2048


@triton.jit
def _a_tile(a_ptr, d_ptr, norm_ptr, row_off, k, mask):
    """A operand a[row, k] as bf16 (and, for lm_head_last, s^2 as fp32; with the prologue, h from
    x and d and the row's inv):
    row_off [R, 1] and k [1, BK] -> [R, BK], or row_off [1] and k [BK] -> [BK]."""
    s = tl.load(_ptr(a_ptr, row_off + k), mask=mask, other=0.0).to(tl.float32)
    s = s + tl.load(_ptr(d_ptr, row_off + k), mask=mask, other=0.0).to(tl.float32)
    s = s.to(tl.bfloat16).to(tl.float32)
    nw = tl.load(_ptr(norm_ptr, k), mask=k < 2048, other=0.0).to(tl.float32)
    return (s * nw).to(tl.bfloat16), s * s


@triton.jit
def _w_tile(w_rows, k, k_end):
    """W[n, k] tile, zero at k >= k_end; w_rows [BN, 1] row pointers (rows clamped in range),
    k [1, BK]."""
    return tl.load(_ptr(w_rows, k), mask=k < k_end, other=0.0, eviction_policy="evict_first")


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
def lm_head_last(a_ptr, d_ptr, norm_ptr, w_ptr, y_ptr, M, rows_ptr,
        N: tl.constexpr, K: tl.constexpr, BLOCK_N: tl.constexpr, FMA_BLOCK_K: tl.constexpr,
        FMA_T: tl.constexpr, FMA_ROWS: tl.constexpr, BLOCK_N_DOT: tl.constexpr, BLOCK_K: tl.constexpr,
        BLOCK_T: tl.constexpr, KU: tl.constexpr, SPLIT: tl.constexpr, SLOT: tl.constexpr,
        ZMAX: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
    if PDL:
        gdc_wait()   # earlier kernels' writes are visible from here on
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
        w_rows = w_ptr + tl.minimum(offs_n, N - 1).to(tl.int64)[:, None] * K
        r0 = tl.full([1], 0, tl.int32)
        ok0 = r0 < M
        row0 = _row_start(rows_ptr, r0, ok0)
        acc0 = tl.zeros([BLOCK_N, FMA_BLOCK_K], tl.float32)
        ss0 = tl.zeros([FMA_BLOCK_K], tl.float32)
        for k0 in range(k_lo, k_hi, FMA_BLOCK_K):
            kf = k0 + tl.arange(0, FMA_BLOCK_K)
            wf = _w_tile(w_rows, kf[None, :], K).to(tl.float32)
            a0, sq0 = _a_tile(a_ptr, d_ptr, norm_ptr, row0, kf, ok0 & (kf < K))
            ss0 += sq0
            acc0 += wf * a0.to(tl.float32)[None, :]

        rows = tl.arange(0, FMA_T)
        out = tl.zeros([FMA_T, BLOCK_N], tl.float32)
        rstd0 = 1.0 / tl.sqrt(tl.sum(ss0, axis=0) / K + 1e-06)
        out = tl.where(rows[:, None] == 0, tl.sum(acc0, axis=1)[None, :] * rstd0, out)
        offs_f = rows.to(tl.int64)[:, None] * N + offs_n[None, :]
        _finish(y_ptr, y_ptr, y_ptr, out, offs_f, (rows[:, None] < M) & n_mask[None, :], tile, SPLIT, SLOT, ZMAX)


META = {
    "entry": "lm_head_last",
    "params": [["a_ptr", "*bf16", "in:0"], ["d_ptr", "*bf16", "in:1"], ["norm_ptr", "*bf16", "in:2"], ["w_ptr", "*bf16", "in:3"], ["y_ptr", "*fp32", "out:0"], ["M", "i32", "dim:B"], ["rows_ptr", "*i32", "meta:last_rows"]],
    "constexprs": {"N": 128256, "K": 2048, "BLOCK_N": 16, "FMA_BLOCK_K": 512,
                   "FMA_T": 1, "FMA_ROWS": 1, "BLOCK_N_DOT": 128, "BLOCK_K": 64,
                   "BLOCK_T": 32, "KU": 512, "SPLIT": False, "SLOT": 128256,
                   "ZMAX": 1,
                   "DOT_F32": False, "PDL": True},
    "pdl": True,
    "grid": ["cdiv(B, 32)", 8016, 1],
    "num_warps": 4,
    "num_stages": 3,
}
