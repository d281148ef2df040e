# hc_streams (ops/hyper_connection.py): out[t, n, :] = x[t, :] for the N = 4 streams (H = 4096).
# One program per (token, BLOCK = 1024 columns).
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def hc_streams(x_ptr, out_ptr, N: tl.constexpr, H: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
    if PDL:
        gdc_wait()   # earlier kernels' writes are visible from here on
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    hm = h < H
    x = tl.load(x_ptr + t * H + h, mask=hm).to(out_ptr.dtype.element_ty)
    for n in tl.static_range(N):
        tl.store(out_ptr + (t * N + n) * H + h, x, mask=hm)


META = {
    "entry": "hc_streams",
    "params": [["x_ptr", "*bf16", "in:0"], ["out_ptr", "*bf16", "out:0"]],
    "constexprs": {"N": 4, "H": 4096, "BLOCK": 1024, "PDL": True},
    "pdl": True,
    "grid": ["T", 4, 1],
    "num_warps": 4,
    "num_stages": 1,
}
