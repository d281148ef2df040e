# gemm: y[t, n] = sum_k x[t, k] * w[n, k]  for t < T
#   x [T, 4864] bf16, w [896, 4864] bf16, y [T, 896] bf16; fp32 accumulate.
#
# Tiled tensor-core GEMM for many rows: one program per [BLOCK_M, BLOCK_N] output tile, a K loop
# of BLOCK_K steps that the compiler software-pipelines over num_stages shared-memory buffers
# (cp.async, wgmma on sm_90). Programs are ordered in groups of GROUP_M row tiles per column
# tile sweep, so a group's A rows and W columns stay in L2. Edges: rows past T and columns past
# N are clamped for loading (the loads stay unmasked and vectorized) and masked at the store.
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
def _a_tile(a_ptr, row_off, k):
    """A operand a[row, k] as bf16, row_off [BM, 1] (int64 element offsets), k [1, BK]."""
    return tl.load(_ptr(a_ptr, row_off + k), mask=k < 4864, other=0.0)


@triton.jit
def _write(y_ptr, bias_ptr, acc, offs, offs_n, mask, N: tl.constexpr):
    """The fp32 tile, rounded once to the output dtype."""
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def gemm(a_ptr, w_ptr, y_ptr, T,        N: tl.constexpr, K: tl.constexpr, A_STRIDE: tl.constexpr, BLOCK_M: tl.constexpr,
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
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)[None, :]
        a = _a_tile(a_ptr, a_rows, k)
        w = tl.load(_ptr(w_rows, k), mask=k < K, other=0.0)
        if DOT_F32:
            acc = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(w), acc)
    offs = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    mask = (offs_m[:, None] < T) & (offs_n[None, :] < N)
    _write(y_ptr, y_ptr, acc, offs, offs_n, mask, N)


META = {
    "entry": "gemm",
    "params": [["a_ptr", "*bf16", "in:0"], ["w_ptr", "*bf16", "in:1"],
               ["y_ptr", "*bf16", "out:0"], ["T", "i32", "dim:T"]],
    "constexprs": {"N": 896, "K": 4864, "A_STRIDE": 4864, "BLOCK_M": 128,
                   "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8,
                   "SPLIT": False, "ZMAX": 1, "SLOT": 917504, "DOT_F32": False},
    "grid": ["cdiv(T, 128) * 7", 1, 1],
    "num_warps": 8,
    "num_stages": 4,
}
