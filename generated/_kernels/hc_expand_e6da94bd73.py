# hc_expand (ops/hyper_connection.py): out[t, k, :] = post[t, k] y[t, :] + sum_j comb[t, j, k] x[t, j, :]
# (N = 4, H = 4096), fp32 math, one rounding. One program per (token, BLOCK = 256 columns): it reads
# every stream's columns before it writes them.
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def hc_expand(y_ptr, x_ptr, post_ptr, comb_ptr, out_ptr, N: tl.constexpr, NP: tl.constexpr, H: tl.constexpr,
              BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
    if PDL:
        gdc_wait()   # earlier kernels' writes are visible from here on
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    n = tl.arange(0, NP)
    hm = h < H
    nm = n < N
    m2 = nm[:, None] & hm[None, :]
    x = tl.load(x_ptr + t * (N * H) + n[:, None] * H + h[None, :], mask=m2, other=0.0).to(tl.float32)   # [j, h]
    c = tl.load(comb_ptr + t * (N * N) + n[:, None] * N + n[None, :], mask=nm[:, None] & nm[None, :],
                other=0.0).to(tl.float32)                                                             # [j, k]
    mixed = tl.sum(c[:, :, None] * x[:, None, :], axis=0)                                             # [k, h]
    post = tl.load(post_ptr + t * N + n, mask=nm, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + t * H + h, mask=hm, other=0.0).to(tl.float32)
    out = post[:, None] * y[None, :] + mixed
    tl.store(out_ptr + t * (N * H) + n[:, None] * H + h[None, :], out.to(out_ptr.dtype.element_ty), mask=m2)


META = {
    "entry": "hc_expand",
    "params": [["y_ptr", "*bf16", "in:0"], ["x_ptr", "*bf16", "in:1"],
               ["post_ptr", "*fp32", "in:2"], ["comb_ptr", "*fp32", "in:3"],
               ["out_ptr", "*bf16", "out:0"]],
    "constexprs": {"N": 4, "NP": 4, "H": 4096, "BLOCK": 256, "PDL": True},
    "pdl": True,
    "grid": ["T", 16, 1],
    "num_warps": 4,
    "num_stages": 1,
}
