# layer_norm over the last axis of x [B, 768] (bf16), as torch.nn.LayerNorm:
#   mean = sum(x) / N,  var = sum((x - mean)^2) / N  (biased),  N = 768
#   out = (x - mean) * rsqrt(var + eps) * w + b
# fp32 math, one rounding to bf16. The variance is taken about the mean (two passes), not
# as E[x^2] - mean^2, which cancels for rows with a large mean. One program per row; a row
# longer than BLOCK is read three times (sum, squared deviations, normalize).
# x may be a row-strided view: its first dim's rows are STRIDE = 768 elements apart, each holding
# INNER = 1 norm rows of N contiguous elements; out is contiguous.
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def layer_norm(x_ptr, w_ptr, b_ptr, out_ptr, N: tl.constexpr, INNER: tl.constexpr,
               STRIDE: tl.constexpr, EPS: tl.constexpr, BLOCK: tl.constexpr, CHUNKS: tl.constexpr, PDL: tl.constexpr):
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
        mean = tl.sum(x, axis=0) / N
        d = tl.where(mask, x - mean, 0.0)
        inv = tl.math.rsqrt(tl.sum(d * d, axis=0) / N + EPS)
        y = d * inv * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        y += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row + cols, y.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for c in range(CHUNKS):
            offs = c * BLOCK + cols
            acc += tl.load(x_ptr + src + offs, mask=offs < N, other=0.0).to(tl.float32)
        mean = tl.sum(acc, axis=0) / N
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for c in range(CHUNKS):
            offs = c * BLOCK + cols
            mask = offs < N
            x = tl.load(x_ptr + src + offs, mask=mask, other=0.0).to(tl.float32)
            d = tl.where(mask, x - mean, 0.0)
            acc += d * d
        inv = tl.math.rsqrt(tl.sum(acc, axis=0) / N + EPS)
        for c in range(CHUNKS):
            offs = c * BLOCK + cols
            mask = offs < N
            x = tl.load(x_ptr + src + offs, mask=mask, other=0.0).to(tl.float32)
            y = (x - mean) * inv * tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            y += tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(out_ptr + row + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


META = {
    "entry": "layer_norm",
    "params": [["x_ptr", "*bf16", "in:0"], ["w_ptr", "*bf16", "in:1"],
               ["b_ptr", "*bf16", "in:2"],
               ["out_ptr", "*bf16", "out:0"]],
    "constexprs": {"N": 768, "INNER": 1, "STRIDE": 768, "EPS": 1e-05, "BLOCK": 1024, "CHUNKS": 1, "PDL": True},
    "pdl": True,
    "grid": ["B", 1, 1],
    "num_warps": 4,
    "num_stages": 1,
}
