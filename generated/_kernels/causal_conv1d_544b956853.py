# causal_conv1d: depthwise causal conv of x [T, C=12288] (rows 20608 elements apart) with weight [C, K=4]
#, per sequence b (new rows seq_starts[b] .. seq_starts[b+1]-1, n of them, and
# cached = context_lens[b] - n tokens before this step). Over u = [left context (K-1 rows), the n new rows]:
#   out[t, c] = silu(sum_k w[c, k] * u[t + k, c])          t = 0 .. n-1
# fp32 math; as HF in a bf16 model, the conv's sum is rounded to bf16 before the activation,
# and the result once more. The left context is the sequence's conv slot
# state[state_slots[b]] [K-1, C] (bf16, storage [num_slots + 1, K-1, C]) when cached > 0,
# else zeros; afterwards the slot holds u's last K-1 rows (the last K-1 inputs).
# Decode: one new token per sequence (row b). Grid (B, cdiv(C, BLOCK_C=256)).
# The slot write comes after a CTA barrier: every thread's reads of the old state are done.
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def causal_conv1d(x_ptr, w_ptr, out_ptr, state, seq_starts, context_lens, state_slots, T, B,
                  C: tl.constexpr, K: tl.constexpr, X_STRIDE: tl.constexpr, BLOCK_C: tl.constexpr,
                  BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_B: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
    if PDL:
        gdc_wait()   # earlier kernels' writes are visible from here on
    pid = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = c < C
    seq = pid
    t0 = pid * 0
    start = tl.load(seq_starts + seq)
    n = tl.load(seq_starts + seq + 1) - start
    cached = tl.load(context_lens + seq) - n
    slot = tl.load(state_slots + seq).to(tl.int64)
    st = state + slot * ((K - 1) * C)
    has_old = (tl.zeros([BLOCK_C], tl.int32) + cached) > 0        # a tensor: the interpreter mis-types scalar bools

    tt = t0 + tl.arange(0, BLOCK_T)                                # token index within the sequence's new rows
    tm = tt < n
    acc = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
    for k in tl.static_range(K):
        src = tt - (K - 1) + k                                     # u row t + k = new row src (src < 0: state row K-1+src)
        w = tl.load(w_ptr + c * K + k, mask=cm, other=0.0).to(tl.float32)
        xm = (tm & (src >= 0))[:, None] & cm[None, :]
        xv = tl.load(x_ptr + (start + src).to(tl.int64)[:, None] * X_STRIDE + c[None, :], mask=xm, other=0.0)
        sm = (tm & (src < 0))[:, None] & (cm & has_old)[None, :]
        sv = tl.load(st + (K - 1 + src)[:, None] * C + c[None, :], mask=sm, other=0.0)
        acc += w[None, :] * (xv.to(tl.float32) + sv.to(tl.float32))
    acc = acc.to(out_ptr.dtype.element_ty).to(tl.float32)       # HF: the conv's output is rounded, then silu
    acc = acc / (1.0 + tl.exp(-acc))
    tl.store(out_ptr + (start + tt).to(tl.int64)[:, None] * C + c[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=tm[:, None] & cm[None, :])

    if t0 == 0:
        # new state row j = u[n + j]: old state row n + j while n + j < K-1, else new row n + j - (K-1)
        j = tl.arange(0, BLOCK_S)
        u = n + j
        jm = j < K - 1
        om = (jm & (u < K - 1))[:, None] & (cm & has_old)[None, :]
        old = tl.load(st + u[:, None] * C + c[None, :], mask=om, other=0.0)
        nm = (jm & (u >= K - 1))[:, None] & cm[None, :]
        new = tl.load(x_ptr + (start + u - (K - 1)).to(tl.int64)[:, None] * X_STRIDE + c[None, :], mask=nm, other=0.0)
        tl.debug_barrier()
        tl.store(st + j[:, None] * C + c[None, :], (old.to(tl.float32) + new.to(tl.float32)).to(state.dtype.element_ty),
                 mask=jm[:, None] & cm[None, :])


META = {
    "entry": "causal_conv1d",
    "params": [
        ["x_ptr", "*bf16", "in:0"],
        ["w_ptr", "*bf16", "in:1"],
        ["out_ptr", "*bf16", "out:0"],
        ["state", "*bf16", "cache:conv"],
        ["seq_starts", "*i32", "meta:seq_starts"],
        ["context_lens", "*i32", "meta:context_lens"],
        ["state_slots", "*i32", "meta:state_slots"],
        ["T", "i32", "dim:T"],
        ["B", "i32", "dim:B"],
    ],
    "constexprs": {"C": 12288, "K": 4, "X_STRIDE": 20608, "BLOCK_C": 256,
                   "BLOCK_T": 1, "BLOCK_S": 4, "BLOCK_B": 256, "PDL": True},
    "pdl": True,
    "grid": ["B", 48, 1],
    "num_warps": 4,
    "num_stages": 1,
}
