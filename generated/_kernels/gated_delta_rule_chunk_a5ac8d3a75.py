# gated_delta_rule, chunked (prefill / mixed): q, k [T, Hk=16, Dk=128], v [T, Hv=32, Dv=128], g, beta [T, Hv] -> o [T, Hv, Dv].
# Per sequence b (rows seq_starts[b] .. +n, cached = context_lens[b] - n before this step) and v-head h (q/k head
# h // 2), state S [Dk, Dv] fp32, token by token (HF's torch_recurrent_gated_delta_rule):
#   S = S * exp(g_t);  S = S + k_t^T (beta_t (v_t - k_t S));  o_t = (q_t * scale) S        scale = 0.08838834764831845
# S starts as the sequence's slot state[state_slots[b], h] (f32, storage [num_slots + 1, Hv, Dk, Dv])
# when cached > 0, else zeros; the final S is written back there.
# The same in chunks of BT=32 tokens (the WY / UT-transform form of DeltaNet; flash-linear-attention's
# chunk_gated_delta_rule and HF's torch_chunk_gated_delta_rule compute it this way). Within a chunk, with
# G_i = g_1 + .. + g_i (cumulative log decay), D_ij = exp(G_i - G_j) for i >= j (0 above), S0 the state before it:
#   A   = strict_lower(beta_i k_i . k_j D_ij)          [BT, BT]
#   X   = (I + A)^-1                                     forward substitution, row by row (unit lower triangular)
#   W   = X (beta k exp(G)),  U = X (beta v)            the delta-rule corrections, all at once
#   V'  = U - W S0                                      the new values each token writes
#   o   = scale (q exp(G)) S0 + scale (q k^T . D) V'    (D with its diagonal)
#   S   = exp(G_last) S0 + (k exp(G_last - G))^T V'
# Rows past the sequence's end are zeros (k = v = beta = g = 0): they change nothing.
# W and U arrive made (delta_rule_wy, every chunk at once, for these chunks of BT rows: compiler/passes/
# split_delta_rule.py), so the walk over the chunks in order keeps only the products with the state: v and beta
# are not read here.
# q and k arrive raw and are l2-normalized here, a row at a time in fp32: x * rsqrt(sum(x^2) + 1e-06)
# (compiler/passes/fuse_delta_rule.py; the l2_norm launches it replaces wrote them as f32).
# The gates made here from their projections (compiler/passes/fuse_delta_rule.py): g = A[h] * softplus(a + dt_bias[h])
# in fp32, beta = sigmoid(b) rounded to bf16 as the launch it replaces stored it; zero past the end, as above.
# Grid (B, Hv, cdiv(Dv, BV=64)): a program carries S [BK=128, BV] in registers across its sequence's chunks
# (the v columns are independent). k/q dots take q, k as they come (bf16, bf16);
# fp32 operand dots use input_precision tf32.
import triton
import triton.language as tl


@triton.jit
def gated_delta_rule_chunk(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, dt_bias_ptr, A_ptr, w_ptr, u_ptr, o_ptr, state, seq_starts, context_lens, state_slots, T, B,
                           HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                           BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr, SCALE: tl.constexpr,
                           Q_STRIDE: tl.constexpr, K_STRIDE: tl.constexpr, V_STRIDE: tl.constexpr,
                           G_STRIDE: tl.constexpr, B_STRIDE: tl.constexpr, DOT_F32: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // (HV // HK)
    start = tl.load(seq_starts + b)
    n = tl.load(seq_starts + b + 1) - start
    cached = tl.load(context_lens + b) - n
    slot = tl.load(state_slots + b).to(tl.int64)

    kk = tl.arange(0, BK)
    km = kk < DK
    vv = tl.program_id(2) * BV + tl.arange(0, BV)
    vm = vv < DV
    s_off = ((slot * HV + h) * DK + kk[:, None]) * DV + vv[None, :]
    s_m = km[:, None] & vm[None, :]
    S = tl.load(state + s_off, mask=s_m & ((tl.zeros([BK], tl.int32) + cached) > 0)[:, None], other=0.0)

    dt_bias = tl.load(dt_bias_ptr + h)
    A = tl.load(A_ptr + h)
    r = tl.arange(0, BT)
    causal = r[:, None] >= r[None, :]
    for c0 in range(0, n, BT):
        t = c0 + r
        tm = t < n
        row = (start + t).to(tl.int64)
        qk_m = tm[:, None] & km[None, :]
        q = tl.load(q_ptr + row[:, None] * Q_STRIDE + hk * DK + kk[None, :], mask=qk_m, other=0.0)
        k = tl.load(k_ptr + row[:, None] * K_STRIDE + hk * DK + kk[None, :], mask=qk_m, other=0.0)
        g = tl.load(g_ptr + row * G_STRIDE + h, mask=tm, other=0.0).to(tl.float32)
        a = g + dt_bias
        g = tl.where(tm, tl.where(a > 20.0, a, tl.maximum(a, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(a)))) * A, 0.0)
        q = q.to(tl.float32)
        q = q * tl.math.rsqrt(tl.sum(q * q, 1) + 1e-06)[:, None]
        k = k.to(tl.float32)
        k = k * tl.math.rsqrt(tl.sum(k * k, 1) + 1e-06)[:, None]
        G = tl.cumsum(g, 0)
        D = tl.exp(tl.where(causal, G[:, None] - G[None, :], float("-inf")))
        eG = tl.exp(G)
        kf = k.to(tl.float32)
        W = tl.load(w_ptr + row[:, None] * (HV * DK) + h * DK + kk[None, :], mask=qk_m, other=0.0)   # [BT, BK]
        U = tl.load(u_ptr + row[:, None] * (HV * DV) + h * DV + vv[None, :], mask=tm[:, None] & vm[None, :],
                    other=0.0)                                                                    # [BT, BV]
        vn = U - tl.dot(W, S, input_precision="tf32")
        qkt = tl.dot(q, tl.trans(k), input_precision="tf32") * D
        o = tl.dot(q.to(tl.float32) * eG[:, None], S, input_precision="tf32") + \
            tl.dot(qkt, vn, input_precision="tf32")
        tl.store(o_ptr + row[:, None] * (HV * DV) + h * DV + vv[None, :], (o * SCALE).to(o_ptr.dtype.element_ty),
                 mask=tm[:, None] & vm[None, :])
        g_last = tl.sum(g, 0)
        kd = kf * tl.exp(g_last - G)[:, None]
        S = S * tl.exp(g_last) + tl.dot(tl.trans(kd), vn, input_precision="tf32")

    tl.store(state + s_off, S, mask=s_m)


META = {
    "entry": "gated_delta_rule_chunk",
    "params": [
        ["q_ptr", "*bf16", "in:0"],
        ["k_ptr", "*bf16", "in:1"],
        ["v_ptr", "*bf16", "in:2"],
        ["g_ptr", "*bf16", "in:3"],
        ["beta_ptr", "*bf16", "in:4"],
        ["dt_bias_ptr", "*fp32", "in:5"],
        ["A_ptr", "*fp32", "in:6"],
        ["w_ptr", "*fp32", "in:7"],
        ["u_ptr", "*fp32", "in:8"],
        ["o_ptr", "*bf16", "out:0"],
        ["state", "*fp32", "cache:recurrent"],
        ["seq_starts", "*i32", "meta:seq_starts"],
        ["context_lens", "*i32", "meta:context_lens"],
        ["state_slots", "*i32", "meta:state_slots"],
        ["T", "i32", "dim:T"],
        ["B", "i32", "dim:B"],
    ],
    "constexprs": {"HK": 16, "HV": 32, "DK": 128, "DV": 128, "BK": 128, "BV": 64,
                   "BT": 32, "SCALE": 0.08838834764831845, "Q_STRIDE": 8192, "K_STRIDE": 8192,
                   "V_STRIDE": 8192, "G_STRIDE": 12352, "B_STRIDE": 12352, "DOT_F32": False},
    "grid": ["B", 32, 2],
    "num_warps": 8,
    "num_stages": 1,
}
