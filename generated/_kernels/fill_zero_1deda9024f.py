# fill_zero: out[t, :] = 0 for every token row t < T (T x 1024).
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def fill_zero(out_ptr, T, ROW: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
    if PDL:
        gdc_wait()   # earlier kernels' writes are visible from here on
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.zeros([BLOCK], dtype=out_ptr.dtype.element_ty), mask=offs < T * ROW)


META = {
    "entry": "fill_zero",
    "params": [["out_ptr", "*bf16", "out:0"], ["T", "i32", "dim:T"]],
    "constexprs": {"ROW": 1024, "BLOCK": 1024, "PDL": True},
    "pdl": True,
    "grid": ["cdiv(T * 1024, 1024)", 1, 1],
    "num_warps": 4,
    "num_stages": 1,
}
