# expert_upcast: W[e, n, k] = bf16(W(codes, scales)[e, n, k]) for the 32 experts' [5760, 2880] e2m1 stacks
#   (scales per 1 rows x 32 columns: compiler/ops/quant.py's definition), 1061683200 bytes written.
# Grid: E x 180 row blocks x 12 column blocks of [32, 256], in steps of at least 512 rows
#   (T); below that the grid is empty (the runner skips the launch) and the GEMMs read the codes.
import triton
import triton.language as tl


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
def expert_upcast(w_ptr, w_scale_ptr, out_ptr, N: tl.constexpr, K: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, NN: tl.constexpr, NK: tl.constexpr):
    pid = tl.program_id(0)
    e = pid // (NN * NK)
    nb = (pid % (NN * NK)) // NK
    k0 = (pid % NK) * BLOCK_K
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(n, N - 1).to(tl.int64)[:, None]      # rows past N clamped for loading
    w_rows = w_ptr + e.to(tl.int64) * 8294400 + rows * 1440
    srow = rows // 1
    ws = w_scale_ptr + e.to(tl.int64) * 518400   # expert e's scales

    w = _w_deq(_w_raw(w_rows, k0, K, BLOCK_K), srow, ws, k0, K, BLOCK_K)
    k = k0 + tl.arange(0, BLOCK_K)[None, :]
    out = out_ptr + e.to(tl.int64) * (N * K) + n.to(tl.int64)[:, None] * K + k
    tl.store(out, w.to(tl.bfloat16), mask=(n[:, None] < N) & (k < K))


META = {
    "entry": "expert_upcast",
    "params": [["w_ptr", "*u8", "in:0"], ["w_scale_ptr", "*fp32", "in:1"],
               ["out_ptr", "*bf16", "out:0"]],
    "constexprs": {"N": 5760, "K": 2880, "BLOCK_N": 32, "BLOCK_K": 256, "NN": 180, "NK": 12},
    "grid": ["min(1, max(0, T - 511)) * 69120", 1, 1],
    "num_warps": 4,
    "num_stages": 1,
}
