# add: out = a + b elementwise over [T, 3072], fp32 math, one rounding to bf16.
# One program per BLOCK elements of the flattened tensor; int64 offsets.
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def add(a_ptr, b_ptr, out_ptr, T, ROW: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
    if PDL:
        gdc_wait()   # earlier kernels' writes are visible from here on
    n = T.to(tl.int64) * ROW
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(a_ptr + offs, mask=mask).to(tl.float32)
    b = tl.load(b_ptr + offs, mask=mask).to(tl.float32)
    tl.store(out_ptr + offs, (a + b).to(out_ptr.dtype.element_ty), mask=mask)


META = {
    "entry": "add",
    "params": [["a_ptr", "*bf16", "in:0"], ["b_ptr", "*bf16", "in:1"],
               ["out_ptr", "*bf16", "out:0"], ["T", "i32", "dim:T"]],
    "constexprs": {"ROW": 3072, "BLOCK": 1024, "PDL": True},
    "pdl": True,
    "grid": ["cdiv(T * 3072, 1024)", 1, 1],
    "num_warps": 4,
    "num_stages": 1,
}
