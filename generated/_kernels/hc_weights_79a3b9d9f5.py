# hc_head_weights (ops/hyper_connection.py): N = 4 streams, mix rows of M = 4, ROWS = 16 tokens a program.
# pre = sigmoid(mix * scale[0] + base) + eps (the hyper head's collapse weights).
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def hc_head_weights(mix_ptr, base_ptr, scale_ptr, pre_ptr, T, N: tl.constexpr,
             NP: tl.constexpr, M: tl.constexpr, ITERS: tl.constexpr, EPS: tl.constexpr, ROWS: tl.constexpr,
             PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
    if PDL:
        gdc_wait()   # earlier kernels' writes are visible from here on
    t = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    ok = t < T
    n = tl.arange(0, NP)
    nm = n < N
    m2 = ok[:, None] & nm[None, :]
    row = mix_ptr + t[:, None] * M
    s = tl.load(scale_ptr).to(tl.float32)
    pre = _sigmoid(tl.load(row + n[None, :], mask=m2, other=0.0).to(tl.float32) * s
                   + tl.load(base_ptr + n, mask=nm, other=0.0).to(tl.float32)[None, :]) + EPS
    tl.store(pre_ptr + t[:, None] * N + n[None, :], pre, mask=m2)


META = {
    "entry": "hc_head_weights",
    "params": [["mix_ptr", "*fp32", "in:0"], ["base_ptr", "*fp32", "in:1"],
               ["scale_ptr", "*fp32", "in:2"], ["pre_ptr", "*fp32", "out:0"],
               ["T", "i32", "dim:T"]],
    "constexprs": {"N": 4, "NP": 4, "M": 4, "ITERS": 1, "EPS": 1e-06,
                   "ROWS": 16, "PDL": True},
    "pdl": True,
    "grid": ["cdiv(T, 16)", 1, 1],
    "num_warps": 4,
    "num_stages": 1,
}
