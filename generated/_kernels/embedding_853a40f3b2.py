# embedding: out[t, :] = table[ids[t], :], ids [T], table [196608, 4096] -> bf16.
# One program per (token, BLOCK columns).
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def embedding(ids_ptr, table_ptr, out_ptr, H: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
    if PDL:
        gdc_wait()   # earlier kernels' writes are visible from here on
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    row = tl.load(ids_ptr + t).to(tl.int64)
    x = tl.load(table_ptr + row * H + cols, mask=mask)
    tl.store(out_ptr + t.to(tl.int64) * H + cols, x.to(out_ptr.dtype.element_ty), mask=mask)


META = {
    "entry": "embedding",
    "params": [["ids_ptr", "*i32", "in:0"], ["table_ptr", "*bf16", "in:1"],
               ["out_ptr", "*bf16", "out:0"]],
    "constexprs": {"H": 4096, "BLOCK": 1024, "PDL": True},
    "pdl": True,
    "grid": ["T", 4, 1],
    "num_warps": 4,
    "num_stages": 1,
}
