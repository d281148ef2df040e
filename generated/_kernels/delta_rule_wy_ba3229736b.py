# delta_rule_wy: k [T, Hk=16, Dk=128], v [T, Hv=32, Dv=128], g, beta [T, Hv] -> W [T, Hv, Dk], U [T, Hv, Dv] (f32).
# Per sequence b (rows seq_starts[b] .. +n) in chunks of BT=32 rows from its first new row, and v-head h (k head
# h // 2), with G_i = g_1 + .. + g_i the chunk's cumulative log decay and D_ij = exp(G_i - G_j):
#   A = strict_lower(beta_i k_i . k_j D_ij)            [BT, BT]
#   X = (I + A)^-1                                      forward substitution, row by row (unit lower triangular)
#   W = X (beta k exp(G)),  U = X (beta v)
# what gated_delta_rule_chunk computes for each chunk before it needs the state, so every chunk is solved at once
# here (compiler/passes/split_delta_rule.py) and the rule's pass over the chunks in order keeps only the products
# with the state. The same dots as that kernel's, in the same shapes: it reads back what it would have made.
# Rows past the sequence's end are zeros (k = v = beta = g = 0) and are not stored.
# k arrives raw and is l2-normalized here, a row at a time in fp32: x * rsqrt(sum(x^2) + 1e-06) (as the rule does).
# The gates made here from their projections, as the rule makes them: g = A[h] * softplus(a + dt_bias[h]) in fp32,
# beta = sigmoid(b) rounded to bf16; zero past the end.
# Grid (cdiv(T, BT) + B, Hv): program p is chunk p of the step's chunks in sequence order (each sequence has
# cdiv(n, BT)); programs past the last chunk exit. fp32 operand dots use input_precision tf32.
import triton
import triton.language as tl


@triton.jit
def delta_rule_wy(k_ptr, v_ptr, g_ptr, beta_ptr, dt_bias_ptr, A_ptr, w_ptr, u_ptr, seq_starts, T, B,
                  HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                  BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr, BLOCK_B: tl.constexpr,
                  K_STRIDE: tl.constexpr, V_STRIDE: tl.constexpr, G_STRIDE: tl.constexpr, B_STRIDE: tl.constexpr,
                  DOT_F32: tl.constexpr):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // (HV // HK)

    # which sequence and chunk block: count the sequences whose blocks all come before pid
    seq = pid * 0
    first_blk = pid * 0
    carry = pid * 0
    for c0 in range(0, B, BLOCK_B):
        bi = c0 + tl.arange(0, BLOCK_B)
        bm = bi < B
        lo = tl.load(seq_starts + bi, mask=bm, other=0)
        hi = tl.load(seq_starts + bi + 1, mask=bm, other=0)
        nblk = (hi - lo + BT - 1) // BT
        before = (tl.cumsum(nblk, 0) + carry <= pid) & bm
        seq += tl.sum(before.to(tl.int32), 0)
        first_blk += tl.sum(tl.where(before, nblk, 0), 0)
        carry += tl.sum(nblk, 0)
    if seq >= B:
        return
    start = tl.load(seq_starts + seq)
    n = tl.load(seq_starts + seq + 1) - start
    c0 = (pid - first_blk) * BT

    kk = tl.arange(0, BK)
    km = kk < DK
    r = tl.arange(0, BT)
    t = c0 + r
    tm = t < n
    row = (start + t).to(tl.int64)
    k = tl.load(k_ptr + row[:, None] * K_STRIDE + hk * DK + kk[None, :], mask=tm[:, None] & km[None, :], other=0.0)
    g = tl.load(g_ptr + row * G_STRIDE + h, mask=tm, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + row * B_STRIDE + h, mask=tm, other=0.0).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + h)
    A = tl.load(A_ptr + h)
    a = g + dt_bias
    g = tl.where(tm, tl.where(a > 20.0, a, tl.maximum(a, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(a)))) * A, 0.0)
    beta = tl.where(tm, (1.0 / (1.0 + tl.exp(-beta))).to(tl.bfloat16).to(tl.float32), 0.0)
    k = k.to(tl.float32)
    k = k * tl.math.rsqrt(tl.sum(k * k, 1) + 1e-06)[:, None]
    G = tl.cumsum(g, 0)
    causal = r[:, None] >= r[None, :]
    D = tl.exp(tl.where(causal, G[:, None] - G[None, :], float("-inf")))
    # A^T (At[j, i] = A[i, j]) so that row i of A comes out indexed along axis 0
    kkt = tl.dot(k, tl.trans(k), input_precision="tf32")
    At = tl.where(r[:, None] < r[None, :], tl.trans(kkt * D) * beta[None, :], 0.0)
    X = (r[:, None] == r[None, :]).to(tl.float32)
    for i in range(1, tl.minimum(n - c0, BT)):
        a_i = tl.sum(tl.where(r[None, :] == i, At, 0.0), 1)            # A[i, :]
        xi = -tl.sum(a_i[:, None] * X, 0)                               # -sum_j A[i, j] X[j, :]
        X = tl.where(r[:, None] == i, X + xi[None, :], X)
    kf = k.to(tl.float32)
    W = tl.dot(X, kf * (beta * tl.exp(G))[:, None], input_precision="tf32")      # [BT, BK]
    tl.store(w_ptr + row[:, None] * (HV * DK) + h * DK + kk[None, :], W, mask=tm[:, None] & km[None, :])
    for v0 in tl.static_range(0, DV, BV):
        vv = v0 + tl.arange(0, BV)
        vm = vv < DV
        v = tl.load(v_ptr + row[:, None] * V_STRIDE + h * DV + vv[None, :], mask=tm[:, None] & vm[None, :],
                    other=0.0).to(tl.float32)
        U = tl.dot(X, v * beta[:, None], input_precision="tf32")                   # [BT, BV]
        tl.store(u_ptr + row[:, None] * (HV * DV) + h * DV + vv[None, :], U, mask=tm[:, None] & vm[None, :])


META = {
    "entry": "delta_rule_wy",
    "params": [
        ["k_ptr", "*bf16", "in:0"],
        ["v_ptr", "*bf16", "in:1"],
        ["g_ptr", "*bf16", "in:2"],
        ["beta_ptr", "*bf16", "in:3"],
        ["dt_bias_ptr", "*fp32", "in:4"],
        ["A_ptr", "*fp32", "in:5"],
        ["w_ptr", "*fp32", "out:0"],
        ["u_ptr", "*fp32", "out:1"],
        ["seq_starts", "*i32", "meta:seq_starts"],
        ["T", "i32", "dim:T"],
        ["B", "i32", "dim:B"],
    ],
    "constexprs": {"HK": 16, "HV": 32, "DK": 128, "DV": 128, "BK": 128, "BV": 64,
                   "BT": 32, "BLOCK_B": 64, "K_STRIDE": 8192, "V_STRIDE": 8192,
                   "G_STRIDE": 12352, "B_STRIDE": 12352, "DOT_F32": False},
    "grid": ["cdiv(T, 32) + B", 32, 1],
    "num_warps": 4,
    "num_stages": 1,
}
