# sigmoid elementwise over [T, 6144]: out = (1.0 / (1.0 + tl.exp(-x)))
# fp32 math, one rounding to bf16. One program per BLOCK elements of the flattened
# tensor; int64 offsets. x's rows are 14336 elements apart (a column slice).
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def sigmoid(x_ptr, out_ptr, T, ROW: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
    if PDL:
        gdc_wait()   # earlier kernels' writes are visible from here on
    n = T.to(tl.int64) * ROW
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + (offs // ROW) * 14336 + offs % ROW, mask=mask).to(tl.float32)
    tl.store(out_ptr + offs, (1.0 / (1.0 + tl.exp(-x))).to(out_ptr.dtype.element_ty), mask=mask)


META = {
    "entry": "sigmoid",
    "params": [["x_ptr", "*bf16", "in:0"],
               ["out_ptr", "*bf16", "out:0"], ["T", "i32", "dim:T"]],
    "constexprs": {"ROW": 6144, "BLOCK": 1024, "PDL": True},
    "pdl": True,
    "grid": ["cdiv(T * 6144, 1024)", 1, 1],
    "num_warps": 4,
    "num_stages": 1,
}
