# rms_norm over the last axis of x [T, 256] (bf16), w bf16, fp32 math, in HF's order:
#   out = round(round(x * rsqrt(mean(x^2) + eps)) * w)
# where round() is the cast to x's dtype: Llama's order (normalize in fp32, cast back, then
# multiply by the bf16 weight).
# One program per row of N = 256; rows longer than BLOCK take two passes over x.
# x may be a row-strided view: its first dim's rows are STRIDE = 1344 elements apart, each holding
# INNER = 1 norm rows (heads) of N contiguous elements; out is contiguous.
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def rms_norm(x_ptr, w_ptr, out_ptr, N: tl.constexpr, INNER: tl.constexpr, STRIDE: tl.constexpr,
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
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        n = (x * inv).to(x_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + row + cols, (n * w).to(out_ptr.dtype.element_ty), mask=mask)
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
            w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            n = (x * inv).to(x_ptr.dtype.element_ty).to(tl.float32)
            tl.store(out_ptr + row + offs, (n * w).to(out_ptr.dtype.element_ty), mask=mask)


META = {
    "entry": "rms_norm",
    "params": [["x_ptr", "*bf16", "in:0"], ["w_ptr", "*bf16", "in:1"],
               ["out_ptr", "*bf16", "out:0"]],
    "constexprs": {"N": 256, "INNER": 1, "STRIDE": 1344, "EPS": 1e-06, "BLOCK": 256, "CHUNKS": 1, "PDL": True},
    "pdl": True,
    "grid": ["T", 1, 1],
    "num_warps": 1,
    "num_stages": 1,
}
