# add_rms_norm over rows of x [T, 4608] (bf16), w f32, fp32 math, in HF's order:
#   s = round(x + delta)                          -> out:0, written over x (the residual stream)
#   h = round(s * rsqrt(mean(s^2) + eps) * w)          -> out:1
# where round() is the cast to the activation dtype: HF adds the residual in bf16; the f32 weight
# (Gemma's and Qwen3.5's 1 + w.float()) multiplies in fp32 and the product is rounded once.
# One program per row. The row lives in registers when it fits one BLOCK; otherwise a first
# pass stores s and sums s^2 chunk by chunk, and a second pass reads s back (exact: it is the
# rounded value) to normalize. res_ptr and x_ptr are the same buffer: each element is read
# before the same program overwrites it, and no other program touches the row.
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def add_rms_norm(x_ptr, d_ptr, w_ptr, res_ptr, h_ptr, H: tl.constexpr, EPS: tl.constexpr,
                 BLOCK: tl.constexpr, CHUNKS: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
    if PDL:
        gdc_wait()   # earlier kernels' writes are visible from here on
    row = tl.program_id(0).to(tl.int64) * H
    cols = tl.arange(0, BLOCK)
    if CHUNKS == 1:
        mask = cols < H
        x = tl.load(x_ptr + row + cols, mask=mask, other=0.0).to(tl.float32)
        d = tl.load(d_ptr + row + cols, mask=mask, other=0.0).to(tl.float32)
        s = (x + d).to(res_ptr.dtype.element_ty)
        tl.store(res_ptr + row + cols, s, mask=mask)
        s = s.to(tl.float32)
        inv = tl.math.rsqrt(tl.sum(s * s, axis=0) / H + EPS)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        n = s * inv
        tl.store(h_ptr + row + cols, (n * w).to(h_ptr.dtype.element_ty), mask=mask)
    else:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for c in range(CHUNKS):
            offs = c * BLOCK + cols
            mask = offs < H
            x = tl.load(x_ptr + row + offs, mask=mask, other=0.0).to(tl.float32)
            d = tl.load(d_ptr + row + offs, mask=mask, other=0.0).to(tl.float32)
            s = (x + d).to(res_ptr.dtype.element_ty)
            tl.store(res_ptr + row + offs, s, mask=mask)
            s = s.to(tl.float32)
            acc += s * s
        inv = tl.math.rsqrt(tl.sum(acc, axis=0) / H + EPS)
        tl.debug_barrier()   # the second pass reads s that other threads of the program stored
        for c in range(CHUNKS):
            offs = c * BLOCK + cols
            mask = offs < H
            s = tl.load(res_ptr + row + offs, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            n = s * inv
            tl.store(h_ptr + row + offs, (n * w).to(h_ptr.dtype.element_ty), mask=mask)


META = {
    "entry": "add_rms_norm",
    "params": [["x_ptr", "*bf16", "in:0"], ["d_ptr", "*bf16", "in:1"],
               ["w_ptr", "*fp32", "in:2"], ["res_ptr", "*bf16", "out:0"],
               ["h_ptr", "*bf16", "out:1"]],
    "constexprs": {"H": 4608, "EPS": 1e-06, "BLOCK": 8192, "CHUNKS": 1, "PDL": True},
    "pdl": True,
    "grid": ["T", 1, 1],
    "num_warps": 8,
    "num_stages": 1,
}
