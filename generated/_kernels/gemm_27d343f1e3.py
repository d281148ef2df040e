# gemm: y[t, n] = sum_k x[t, k] * w[n, k]  for t < T
#   x [T, 4096] bf16, w [17408, 4096] bf16, y [T, 17408] bf16; fp32 accumulate.
#
# Tiled tensor-core GEMM for many rows: 132 persistent programs, each looping over
# [BLOCK_M, BLOCK_N] output tiles, a K loop of BLOCK_K steps whose A and W tiles
# arrive by TMA (descriptors made on the device), software-pipelined over num_stages
# shared-memory buffers (wgmma on sm_90). Tiles go in groups of GROUP_M row tiles per column tile
# sweep, so a group's A rows and W columns stay in L2. Edges: TMA reads zeros past T, N and K;
# the store is masked.
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
    return tl.load(_ptr(a_ptr, row_off + k), mask=k < 4096, other=0.0)


@triton.jit
def _write(y_ptr, bias_ptr, acc, offs, offs_n, mask, N: tl.constexpr):
    """The fp32 tile, rounded once to the output dtype."""
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _tile_of(t, num_m, num_n: tl.constexpr, GROUP_M: tl.constexpr):
    """Tile t's (row tile, column tile) in grouped order: GROUP_M row tiles walk the column tiles
    together."""
    group = t // (GROUP_M * num_n)
    first_m = group * GROUP_M
    group_size = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (t % (GROUP_M * num_n)) % group_size, (t % (GROUP_M * num_n)) // group_size


@triton.jit
def _tma_tile(a_desc, w_desc, y_ptr, bias_ptr, T, pid_m, pid_n, N: tl.constexpr, K: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr):
    """One [BLOCK_M, BLOCK_N] output tile: the K loop over TMA tiles, then the store."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K):
        a = a_desc.load([pid_m * BLOCK_M, k0])
        w = w_desc.load([pid_n * BLOCK_N, k0])
        if DOT_F32:
            acc = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(w), acc)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    mask = (offs_m[:, None] < T) & (offs_n[None, :] < N)
    _write(y_ptr, bias_ptr, acc, offs, offs_n, mask, N)


@triton.jit
def gemm(a_ptr, w_ptr, y_ptr, T,        N: tl.constexpr, K: tl.constexpr, A_STRIDE: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
        SPLIT: tl.constexpr, ZMAX: tl.constexpr, SLOT: tl.constexpr, DOT_F32: tl.constexpr):
    bias_ptr = y_ptr
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[T, K], strides=[A_STRIDE, 1], block_shape=[BLOCK_M, BLOCK_K])
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K])
    num_m = tl.cdiv(T, BLOCK_M)
    num_n: tl.constexpr = 68
    for t in tl.range(tl.program_id(0), num_m * num_n, 132, flatten=True):
        pid_m, pid_n = _tile_of(t, num_m, num_n, GROUP_M)
        _tma_tile(a_desc, w_desc, y_ptr, bias_ptr, T, pid_m, pid_n, N, K, BLOCK_M, BLOCK_N, BLOCK_K, DOT_F32)


META = {
    "entry": "gemm",
    "params": [["a_ptr", "*bf16", "in:0"], ["w_ptr", "*bf16", "in:1"],
               ["y_ptr", "*bf16", "out:0"], ["T", "i32", "dim:T"]],
    "constexprs": {"N": 17408, "K": 4096, "A_STRIDE": 4096, "BLOCK_M": 128,
                   "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8,
                   "SPLIT": False, "ZMAX": 1, "SLOT": 17825792, "DOT_F32": False},
    "grid": ["min(132, cdiv(T, 128) * 68)", 1, 1],
    "num_warps": 8,
    "num_stages": 3,
}
