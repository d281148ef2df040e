# rms_norm over the last axis of x [T, 64, 512] (bf16), no weight, fp32 math:
#   out = round(x * rsqrt(mean(x^2) + eps))
# where round() is the cast to x's dtype (Llama-4's L2Norm: `_norm(x.float()).type_as(x)`).
# One program per row of N = 512; rows longer than BLOCK take two passes over x.
# x may be a row-strided view: its first dim's rows are STRIDE = 32768 elements apart, each holding
# INNER = 64 norm rows (heads) of N contiguous elements; out is contiguous.
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def rms_norm(x_ptr, out_ptr, N: tl.constexpr, INNER: tl.constexpr, STRIDE: tl.constexpr,
             EPS: tl.constexpr, BLOCK: tl.constexpr, CHUNKS: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
    if PDL:
        gdc_wait()   # earlier kernels' writes are visible from here on
    p = tl.program_id(0).to(tl.int64)
    src = (p // INNER) * STRIDE + (p % INNER) * N
    row = p * N
    cols = tl.arange(0, BLOCK)
    if CHUNKS == 1:
        mask = cols < N
        x = tl.load(x_ptr + src + cols, mask=mask, other=0.0).to(tl.float32)
        inv = tl.math.rsqrt(tl.sum(x * x, axis=0) / N + EPS)
        tl.store(out_ptr + row + cols, (x * inv).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for c in range(CHUNKS):
            offs = c * BLOCK + cols
            x = tl.load(x_ptr + src + offs, mask=offs < N, other=0.0).to(tl.float32)
            acc += x * x
        inv = tl.math.rsqrt(tl.sum(acc, axis=0) / N + EPS)
        for c in range(CHUNKS):
            offs = c * BLOCK + cols
            mask = offs < N
            x = tl.load(x_ptr + src + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(out_ptr + row + offs, (x * inv).to(out_ptr.dtype.element_ty), mask=mask)


META = {
    "entry": "rms_norm",
    "params": [["x_ptr", "*bf16", "in:0"], 
               ["out_ptr", "*bf16", "out:0"]],
    "constexprs": {"N": 512, "INNER": 64, "STRIDE": 32768, "EPS": 1e-06, "BLOCK": 512, "CHUNKS": 1, "PDL": True},
    "pdl": True,
    "grid": ["T * 64", 1, 1],
    "num_warps": 4,
    "num_stages": 1,
}
