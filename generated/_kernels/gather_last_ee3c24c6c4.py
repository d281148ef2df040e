# gather_last (op "last"): out[b, ...] = x[last_rows[b], ...] for x [T, 1024] -> out [B, 1024];
# last_rows[b] is the row of sequence b's last token in this step. A copy (cast to the output dtype).
# One program per (sequence, BLOCK elements of a row).
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def gather_last(x_ptr, rows_ptr, out_ptr, ROW: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
    if PDL:
        gdc_wait()   # earlier kernels' writes are visible from here on
    b = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < ROW
    src = tl.load(rows_ptr + b).to(tl.int64)
    x = tl.load(x_ptr + src * ROW + cols, mask=mask)
    tl.store(out_ptr + b.to(tl.int64) * ROW + cols, x.to(out_ptr.dtype.element_ty), mask=mask)


META = {
    "entry": "gather_last",
    "params": [["x_ptr", "*bf16", "in:0"], ["rows_ptr", "*i32", "meta:last_rows"],
               ["out_ptr", "*bf16", "out:0"]],
    "constexprs": {"ROW": 1024, "BLOCK": 1024, "PDL": True},
    "pdl": True,
    "grid": ["B", 1, 1],
    "num_warps": 4,
    "num_stages": 1,
}
