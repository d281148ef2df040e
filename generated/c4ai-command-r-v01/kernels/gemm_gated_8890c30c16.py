# gemm_silu_gated: y[t, f] = bf16(bf16(silu(g)) * u),  g = bf16(sum_k x[t, k] * w[f, k]),
#   u = bf16(sum_k x[t, k] * w[22528 + f, k]), silu in fp32 (compiler/ops/activation.py): HF's MLP
#   rounds at each of these steps.  x [T, 8192] bf16, w [45056, 8192] bf16 (gate rows, then
#   up rows), y [T, 22528] bf16; fp32 accumulate. A tile's W rows are
#   interleaved (gate f, up f, gate f + 1, ...): one dot per K step, and the accumulator's
#   column pairs split in registers in the epilogue; the [T, 45056] gate|up never goes to memory.
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
    return tl.load(_ptr(a_ptr, row_off + k), mask=k < 8192, other=0.0)


@triton.jit
def _write(y_ptr, bias_ptr, acc, offs, offs_n, mask, N: tl.constexpr):
    """The fp32 tile, rounded once to the output dtype."""
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _write_gated(y_ptr, bias_ptr, acc, offs_m, offs_w, pid_n, T, N: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    """The fp32 [BLOCK_M, BLOCK_N] tile over interleaved gate/up rows offs_w ->
    bf16(bf16(act(g)) * u) on its BLOCK_N / 2 output columns."""
    g, u = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N // 2, 2]))
    g = g.to(tl.bfloat16).to(tl.float32)
    u = u.to(tl.bfloat16).to(tl.float32)
    a = ((g / (1.0 + tl.exp(-g)))).to(tl.bfloat16).to(tl.float32)
    offs_f = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    offs = offs_m.to(tl.int64)[:, None] * N + offs_f[None, :]
    mask = (offs_m[:, None] < T) & (offs_f[None, :] < N)
    tl.store(y_ptr + offs, (a * u).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def gemm_silu_gated(a_ptr, w_ptr, y_ptr, T,        N: tl.constexpr, K: tl.constexpr, A_STRIDE: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
        SPLIT: tl.constexpr, ZMAX: tl.constexpr, SLOT: tl.constexpr, DOT_F32: tl.constexpr):
    # grouped ordering: GROUP_M row tiles walk the column tiles together
    pid = tl.program_id(0)
    num_m = tl.cdiv(T, BLOCK_M)
    num_n: tl.constexpr = 176
    group = pid // (GROUP_M * num_n)
    first_m = group * GROUP_M
    group_size = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % group_size
    pid_n = (pid % (GROUP_M * num_n)) // group_size

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    a_rows = tl.minimum(offs_m, T - 1).to(tl.int64)[:, None] * A_STRIDE
    # W tile row r: gate row f (r even) or up row N + f (r odd), f = pid_n * BLOCK_N / 2 + r / 2,
    # clamped in range for loading (the store masks f >= N)
    r = tl.arange(0, BLOCK_N)
    offs_w = tl.minimum(pid_n * (BLOCK_N // 2) + r // 2, N - 1) + (r % 2) * N
    w_rows = w_ptr + offs_w.to(tl.int64)[:, None] * K
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)[None, :]
        a = _a_tile(a_ptr, a_rows, k)
        w = tl.load(_ptr(w_rows, k), mask=k < K, other=0.0)
        if DOT_F32:
            acc = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(w), acc)
    _write_gated(y_ptr, y_ptr, acc, offs_m, offs_w, pid_n, T, N, BLOCK_M, BLOCK_N)


META = {
    "entry": "gemm_silu_gated",
    "params": [["a_ptr", "*bf16", "in:0"], ["w_ptr", "*bf16", "in:1"],
               ["y_ptr", "*bf16", "out:0"], ["T", "i32", "dim:T"]],
    "constexprs": {"N": 22528, "K": 8192, "A_STRIDE": 8192, "BLOCK_M": 128,
                   "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8,
                   "SPLIT": False, "ZMAX": 1, "SLOT": 46137344, "DOT_F32": False},
    "grid": ["cdiv(T, 128) * 176", 1, 1],
    "num_warps": 8,
    "num_stages": 3,
}
