# gated_delta_rule, one token per sequence (decode): row b of q, k [B, Hk=16, Dk=128], v [B, Hv=32, Dv=128],
# g, beta [B, Hv] -> o [B, Hv, Dv]; v-head h reads q/k head h // 2. One recurrent step on the sequence's state
# S = state[state_slots[b], h] [Dk, Dv] (f32; zeros when nothing is cached before this token,
# context_lens[b] <= 1, as a padding row's 0), as HF's torch_recurrent_gated_delta_rule:
#   S = S * exp(g);  S = S + k^T (beta (v - k S));  o = (q * scale) S        scale = 0.08838834764831845
# then S is written back. Grid (B, Hv, cdiv(Dv, BV=32)): a program holds S[:, its BV columns] (BK=128 rows)
# in registers (the v columns are independent), fp32 math, one rounding of o to bf16.
# q and k arrive raw and are l2-normalized here in fp32: x * rsqrt(sum(x^2) + 1e-06)
# (compiler/passes/fuse_delta_rule.py; the l2_norm launches it replaces wrote them as f32).
# The gates made here from their projections (compiler/passes/fuse_delta_rule.py): g = A[h] * softplus(a + dt_bias[h])
# in fp32, beta = sigmoid(b) rounded to bf16 as the launch it replaces stored it.
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def gated_delta_rule_decode(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, dt_bias_ptr, A_ptr, o_ptr, state, context_lens, state_slots,
                            HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                            BK: tl.constexpr, BV: tl.constexpr, SCALE: tl.constexpr,
                            Q_STRIDE: tl.constexpr, K_STRIDE: tl.constexpr, V_STRIDE: tl.constexpr,
                            G_STRIDE: tl.constexpr, B_STRIDE: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
    b = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // (HV // HK)
    row = b.to(tl.int64)
    cached = tl.load(context_lens + b) - 1
    slot = tl.load(state_slots + b).to(tl.int64)

    kk = tl.arange(0, BK)
    km = kk < DK
    vv = tl.program_id(2) * BV + tl.arange(0, BV)
    vm = vv < DV
    s_off = ((slot * HV + h) * DK + kk[:, None]) * DV + vv[None, :]
    s_m = km[:, None] & vm[None, :]
    # the slot's state before the wait: only this launch writes it in its layer, after the wait, and the step's
    # snapshot restores are copies issued before its first kernel (META reads_before_wait)
    S = tl.load(state + s_off, mask=s_m & ((tl.zeros([BK], tl.int32) + cached) > 0)[:, None], other=0.0)
    if PDL:
        gdc_wait()   # earlier kernels' writes are visible from here on

    q = tl.load(q_ptr + row * Q_STRIDE + hk * DK + kk, mask=km, other=0.0).to(tl.float32)
    q = q * tl.math.rsqrt(tl.sum(q * q, 0) + 1e-06) * SCALE
    k = tl.load(k_ptr + row * K_STRIDE + hk * DK + kk, mask=km, other=0.0).to(tl.float32)
    k = k * tl.math.rsqrt(tl.sum(k * k, 0) + 1e-06)
    v = tl.load(v_ptr + row * V_STRIDE + h * DV + vv, mask=vm, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * G_STRIDE + h).to(tl.float32)
    beta = tl.load(beta_ptr + row * B_STRIDE + h).to(tl.float32)
    a = g + tl.load(dt_bias_ptr + h)
    g = tl.where(a > 20.0, a, tl.maximum(a, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(a)))) * tl.load(A_ptr + h)
    beta = (1.0 / (1.0 + tl.exp(-beta))).to(tl.bfloat16).to(tl.float32)

    S = S * tl.exp(g)
    delta = (v - tl.sum(S * k[:, None], 0)) * beta
    S = S + k[:, None] * delta[None, :]
    o = tl.sum(S * q[:, None], 0)
    tl.store(o_ptr + row * (HV * DV) + h * DV + vv, o.to(o_ptr.dtype.element_ty), mask=vm)
    tl.store(state + s_off, S, mask=s_m)


META = {
    "entry": "gated_delta_rule_decode",
    "params": [
        ["q_ptr", "*bf16", "in:0"],
        ["k_ptr", "*bf16", "in:1"],
        ["v_ptr", "*bf16", "in:2"],
        ["g_ptr", "*bf16", "in:3"],
        ["beta_ptr", "*bf16", "in:4"],
        ["dt_bias_ptr", "*fp32", "in:5"],
        ["A_ptr", "*fp32", "in:6"],
        ["o_ptr", "*bf16", "out:0"],
        ["state", "*fp32", "cache:recurrent"],
        ["context_lens", "*i32", "meta:context_lens"],
        ["state_slots", "*i32", "meta:state_slots"],
    ],
    "constexprs": {"HK": 16, "HV": 32, "DK": 128, "DV": 128, "BK": 128, "BV": 32,
                   "SCALE": 0.08838834764831845, "Q_STRIDE": 8192, "K_STRIDE": 8192,
                   "V_STRIDE": 8192, "G_STRIDE": 12352, "B_STRIDE": 12352, "PDL": True},
    "pdl": True,
    "reads_before_wait": ["state", "context_lens", "state_slots"],
    "grid": ["B", 32, 4],
    "num_warps": 4,
    "num_stages": 1,
}
