# pos_scale: x [T, 32, 320] -> out, row t (ROW=10240 elements) times its position's factor
#   f(p) = 1 + 0.1 * log(1 + floor((p + 0.0) / 8192.0))     (fp32, p = positions[t])
#   out[t] = x[t] * f(p) with f rounded to bf16 first (HF's `.to(dtype)`), one rounding after.
# Grid: (T, cdiv(ROW, BLOCK)); a program scales BLOCK=1024 elements of one row.
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def pos_scale(x_ptr, o_ptr, pos_ptr, T, ROW: tl.constexpr, FLOOR: tl.constexpr, SCALE: tl.constexpr,
              SHIFT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
    if PDL:
        gdc_wait()   # earlier kernels' writes are visible from here on
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < ROW
    p = tl.load(pos_ptr + t).to(tl.float32)
    f = 1.0 + SCALE * tl.log(1.0 + tl.floor((p + SHIFT) / FLOOR))
    f = f.to(o_ptr.dtype.element_ty).to(tl.float32)
    x = tl.load(x_ptr + t * ROW + offs, mask=mask).to(tl.float32)
    tl.store(o_ptr + t * ROW + offs, (x * f).to(o_ptr.dtype.element_ty), mask=mask)


META = {
    "entry": "pos_scale",
    "params": [["x_ptr", "*bf16", "in:0"],
               ["o_ptr", "*bf16", "out:0"],
               ["pos_ptr", "*i32", "meta:positions"],
               ["T", "i32", "dim:T"]],
    "constexprs": {"ROW": 10240, "FLOOR": 8192.0, "SCALE": 0.1, "SHIFT": 0.0,
                   "BLOCK": 1024, "PDL": True},
    "pdl": True,
    "grid": ["T", 10, 1],
    "num_warps": 4,
    "num_stages": 1,
}
