# concat: out[r, :NA] = a[r], out[r, NA:] = b[r] for the rows r of [T, 4096] (NA = 2048,
# NB = 2048; INNER = 1 rows per leading index). One program per (leading index, inner
# row, BLOCK elements of the row).
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def concat(a_ptr, b_ptr, out_ptr, NA: tl.constexpr, NB: tl.constexpr, INNER: tl.constexpr,
           BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
    if PDL:
        gdc_wait()   # earlier kernels' writes are visible from here on
    r = tl.program_id(0).to(tl.int64) * INNER + tl.program_id(1)
    cols = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    in_a = cols < NA
    in_b = (cols >= NA) & (cols < NA + NB)
    x = tl.load(a_ptr + r * NA + cols, mask=in_a, other=0.0)
    y = tl.load(b_ptr + r * NB + (cols - NA), mask=in_b, other=0.0)
    v = tl.where(in_a, x.to(tl.float32), y.to(tl.float32))
    tl.store(out_ptr + r * (NA + NB) + cols, v.to(out_ptr.dtype.element_ty), mask=cols < NA + NB)


META = {
    "entry": "concat",
    "params": [["a_ptr", "*bf16", "in:0"], ["b_ptr", "*bf16", "in:1"],
               ["out_ptr", "*bf16", "out:0"]],
    "constexprs": {"NA": 2048, "NB": 2048, "INNER": 1, "BLOCK": 1024, "PDL": True},
    "pdl": True,
    "grid": ["T", 1, 4],
    "num_warps": 4,
    "num_stages": 1,
}
