# hc_collapse (ops/hyper_connection.py): out[t, :] = sum_n pre[t, n] x[t, n, :] (N = 4, H = 4096),
# fp32 math, one rounding. One program per (token, BLOCK = 512 columns).
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def hc_collapse(x_ptr, pre_ptr, out_ptr, N: tl.constexpr, NP: tl.constexpr, H: tl.constexpr, BLOCK: tl.constexpr,
                PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
    if PDL:
        gdc_wait()   # earlier kernels' writes are visible from here on
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    n = tl.arange(0, NP)
    hm = h < H
    p = tl.load(pre_ptr + t * N + n, mask=n < N, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + t * (N * H) + n[:, None] * H + h[None, :], mask=(n < N)[:, None] & hm[None, :],
                other=0.0).to(tl.float32)
    tl.store(out_ptr + t * H + h, tl.sum(p[:, None] * x, axis=0).to(out_ptr.dtype.element_ty), mask=hm)


META = {
    "entry": "hc_collapse",
    "params": [["x_ptr", "*bf16", "in:0"], ["pre_ptr", "*fp32", "in:1"],
               ["out_ptr", "*bf16", "out:0"]],
    "constexprs": {"N": 4, "NP": 4, "H": 4096, "BLOCK": 512, "PDL": True},
    "pdl": True,
    "grid": ["T", 8, 1],
    "num_warps": 4,
    "num_stages": 1,
}
