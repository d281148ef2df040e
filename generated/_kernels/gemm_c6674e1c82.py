# gemm: y[t, n] = sum_k x[t, k] * w[n, k]  for t < T
#   x [T, 1024] bf16, w [32768, 1024] f8e4m3, y [T, 32768] bf16; fp32 accumulate.
# Quantized W (triton/_quant.j2): f8e4m3 codes, scales per 128 rows x 128 columns,
#   activations dynamic_group (groups of 128). W8A8: each K step dots the e4m3 codes of the A tile (quantized
#   in registers) and of W on the tensor cores (wgmma e4m3 on sm_90) and adds the fp32 sums times
#   a_scale[t] * w_scale[n block] to the accumulator (the block-scaled GEMM of HF / DeepSeek).
#   BLOCK_K = 128 is a multiple of act_group = 128 (a K step quantizes whole groups).
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
def _a_tile(a_ptr, as_ptr, row_off, k):
    """A operand a[row, k] as bf16, row_off [BM, 1] (int64 element offsets), k [1, BK]."""
    # ready codes: code * its group's scale, the value the activation quantizer leaves (fp32)
    c = tl.load(a_ptr + row_off + k, mask=k < 1024, other=0.0).to(tl.float32)
    return c * tl.load(as_ptr + row_off // 1024 * 8 + k // 128, mask=k < 1024, other=0.0)


@triton.jit
def _w_raw(w_rows, k0, k_end, BK: tl.constexpr):
    """The stored codes of W[rows, k0 : k0 + BK], zero past k_end: w_rows [BN, 1] row pointers
    (1024 bytes a row), k0 a multiple of BK -> f8e4m3 [BN, BK]."""
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
    """t[srow, g(k)] (w_scale or w_zero: 8 groups a row) over the tile's columns
    k0 .. k0 + BK: srow [BN, 1] the W rows' scale rows -> [BN, 1] (the tile in one group),
    [BN, BK / 128] (one a group of the tile) or [BN, BK] (a group per column)."""
    if 128 % BK == 0:
        return tl.load(t_ptr + srow * 8 + tl.minimum(k0 // 128, 7))
    elif BK % 128 == 0:
        g = tl.minimum(k0 // 128 + tl.arange(0, BK // 128), 7)[None, :]
        return tl.load(t_ptr + srow * 8 + g)
    else:
        k = k0 + tl.arange(0, BK)[None, :]
        return tl.load(t_ptr + srow * 8 + tl.minimum(k // 128, 7))


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
def _write(y_ptr, bias_ptr, acc, offs, offs_n, mask, N: tl.constexpr):
    """The fp32 tile, rounded once to the output dtype."""
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def gemm(a_ptr, w_ptr, w_scale_ptr, as_ptr, y_ptr, T,        N: tl.constexpr, K: tl.constexpr, A_STRIDE: tl.constexpr, BLOCK_M: tl.constexpr,
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
    w_rows = w_ptr + tl.minimum(offs_n, N - 1).to(tl.int64)[:, None] * 1024
    srow = (tl.minimum(offs_n, N - 1) // 128)[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)[None, :]
        # the ready codes of A (a launch before made them) and their scales
        ac = tl.load(a_ptr + a_rows + k, mask=k < K, other=0.0)
        a_s = tl.load(as_ptr + a_rows // A_STRIDE * 8 + k0 // 128)
        w_s = tl.reshape(_w_group(w_scale_ptr, srow, k0, K, BLOCK_K), [1, BLOCK_N])
        acc += tl.dot(ac, tl.trans(_w_raw(w_rows, k0, K, BLOCK_K))) * a_s * w_s
    offs = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    mask = (offs_m[:, None] < T) & (offs_n[None, :] < N)
    _write(y_ptr, y_ptr, acc, offs, offs_n, mask, N)


META = {
    "entry": "gemm",
    "params": [["a_ptr", "*fp8e4nv", "in:0"], ["w_ptr", "*fp8e4nv", "in:1"],
               ["w_scale_ptr", "*fp32", "in:2"],
               ["as_ptr", "*fp32", "in:3"],
               ["y_ptr", "*bf16", "out:0"], ["T", "i32", "dim:T"]],
    "constexprs": {"N": 32768, "K": 1024, "A_STRIDE": 1024, "BLOCK_M": 128,
                   "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8,
                   "SPLIT": False, "ZMAX": 1, "SLOT": 33554432, "DOT_F32": False},
    "grid": ["cdiv(T, 128) * 256", 1, 1],
    "num_warps": 8,
    "num_stages": 3,
}
