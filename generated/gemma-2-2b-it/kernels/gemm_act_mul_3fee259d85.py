# gemm_gelu_tanh_mul: y[t, n] = sum_k a[t, k] * w[n, k],  a[t, k] = bf16(gelu_tanh(g) * u), g = gu[t, k],
#   u = gu[t, 9216 + k], gelu_tanh in fp32 (compiler/ops/activation.py); a is rounded to bf16 as the
#   unfused model stores it.  gu [T, 18432] bf16, w [2304, 9216] bf16, y [T, 2304];
#   fp32 accumulate. The activation is computed in registers as the A tile is loaded: the
#   [T, 9216] activation never goes to memory.
#
# Tiled tensor-core GEMM for many rows: one program per [BLOCK_M, BLOCK_N] output tile, a K loop
# of BLOCK_K steps that the compiler software-pipelines over num_stages shared-memory buffers
# (cp.async, wgmma on sm_90). Programs are ordered in groups of GROUP_M row tiles per column
# tile sweep, so a group's A rows and W columns stay in L2. Edges: rows past T and columns past
# N are clamped for loading (the loads stay unmasked and vectorized) and masked at the store.
# Split-K (grid z = Z, at most 4, only when T <= 1024 and the tiles are too few for
# 264 programs): program z sums one K range into its own fp32 scratch slot; the last
# program to arrive at a tile (a counter per tile) adds the Z slots in order z = 0 .. Z-1, adds
# the bias and writes the output (a fixed order: the same bits on every run), leaving the
# counter zero.
import triton
import triton.language as tl


@triton.jit
def _tanh(x):
    a = tl.abs(x)
    e = tl.exp(-2.0 * a)
    big = (1.0 - e) / (1.0 + e)
    s = tl.minimum(a, 0.125)             # the series' argument, kept small where it is not used
    s2 = s * s
    small = s * (1.0 + s2 * (-0.3333333333333333 + s2 * (0.13333333333333333 + s2 * -0.05396825396825397)))
    t = tl.where(a < 0.125, small, big)
    return tl.where(x >= 0, t, -t)


@triton.jit
def _ptr(base, offs):
    """base + offs, with the 16-byte alignment of each contiguous run of 8 bf16 made known to the
    compiler (rows are multiples of 8 elements and buffers 16-byte aligned), for vector loads."""
    p = base + offs
    p = tl.multiple_of(p, [1, 16])
    return p


@triton.jit
def _a_tile(a_ptr, row_off, k):
    """A operand a[row, k] as bf16, row_off [BM, 1] (int64 element offsets), k [1, BK]."""
    g = tl.load(_ptr(a_ptr, row_off + k), mask=k < 9216, other=0.0).to(tl.float32)
    u = tl.load(_ptr(a_ptr, row_off + 9216 + k), mask=k < 9216, other=0.0).to(tl.float32)
    return ((0.5 * g * (1.0 + _tanh(0.7978845608028654 * (g + 0.044715 * g * g * g)))) * u).to(tl.bfloat16)


@triton.jit
def _write(y_ptr, bias_ptr, acc, offs, offs_n, mask, N: tl.constexpr):
    """The fp32 tile, rounded once to the output dtype."""
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def gemm_gelu_tanh_mul(a_ptr, w_ptr, y_ptr, T, part_ptr, cnt_ptr,        N: tl.constexpr, K: tl.constexpr, A_STRIDE: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
        SPLIT: tl.constexpr, ZMAX: tl.constexpr, SLOT: tl.constexpr, DOT_F32: tl.constexpr):
    # grouped ordering: GROUP_M row tiles walk the column tiles together
    pid = tl.program_id(0)
    num_m = tl.cdiv(T, BLOCK_M)
    num_n: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
    group = pid // (GROUP_M * num_n)
    first_m = group * GROUP_M
    group_size = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % group_size
    pid_n = (pid % (GROUP_M * num_n)) // group_size

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    a_rows = tl.minimum(offs_m, T - 1).to(tl.int64)[:, None] * A_STRIDE
    w_rows = w_ptr + tl.minimum(offs_n, N - 1).to(tl.int64)[:, None] * K
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    nz = tl.num_programs(1)
    # this program's K range, in whole BLOCK_K steps
    k_chunk = tl.cdiv(tl.cdiv(K, nz), BLOCK_K) * BLOCK_K
    k_lo = tl.program_id(1) * k_chunk
    for k0 in range(k_lo, tl.minimum(K, k_lo + k_chunk), BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)[None, :]
        a = _a_tile(a_ptr, a_rows, k)
        w = tl.load(_ptr(w_rows, k), mask=k < K, other=0.0)
        if DOT_F32:
            acc = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(w), acc)
    offs = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    mask = (offs_m[:, None] < T) & (offs_n[None, :] < N)
    if nz > 1:
        # park the partial sums (as raw fp32 in the untyped scratch), then count in; the barrier
        # orders every thread's stores before the release of the acq_rel atomic
        part = part_ptr.to(tl.pointer_type(tl.float32), bitcast=True)
        tl.store(part + tl.program_id(1) * SLOT + offs, acc, mask=mask)
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + pid, 1, sem="acq_rel")
        if arrived == nz - 1:
            tl.debug_barrier()   # the whole program reads after the acquire above
            total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for z in tl.static_range(ZMAX):   # unrolled: the slot loads are in flight together
                live = mask & (tl.full(offs.shape, z, tl.int32) < nz)
                total += tl.load(part + z * SLOT + offs, mask=live, other=0.0, cache_modifier=".cg")
            _write(y_ptr, y_ptr, total, offs, offs_n, mask, N)
            tl.store(cnt_ptr + pid, 0)
    else:
        _write(y_ptr, y_ptr, acc, offs, offs_n, mask, N)


META = {
    "entry": "gemm_gelu_tanh_mul",
    "params": [["a_ptr", "*bf16", "in:0"], ["w_ptr", "*bf16", "in:1"],
               ["y_ptr", "*bf16", "out:0"], ["T", "i32", "dim:T"],
               ["part_ptr", "*fp32", "scratch:partials"], ["cnt_ptr", "*i32", "scratch:counters"]],
    "constexprs": {"N": 2304, "K": 9216, "A_STRIDE": 18432, "BLOCK_M": 128,
                   "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8,
                   "SPLIT": True, "ZMAX": 4, "SLOT": 2359296, "DOT_F32": False},
    "grid": ["cdiv(T, 128) * 9", "max(1, min(4, 264 // (cdiv(T, 128) * 9))) * max(0, min(1, 1025 - T)) + (1 - max(0, min(1, 1025 - T)))", 1],
    "scratch": {"partials": "37748736", "counters": "288"},
    "num_warps": 8,
    "num_stages": 3,
}
