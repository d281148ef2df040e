# gated_rms_norm over the last axis of x, z [T, 32, 128] (bf16), w [128], HF's
# Qwen3_5RMSNormGated (plain w, not 1 + w) in its order of roundings (round() = cast to bf16):
#   n = round(x * rsqrt(mean(x^2) + eps));  out = round(round(w * n) * silu(z))     (eps = 1e-06)
# with silu(z) = z * sigmoid(z) in fp32. ROWS=16 rows of N=128 per program (BLOCK=128, masked).
# x and z may be row-strided views: their first dim's rows are X_STRIDE = 4096 / Z_STRIDE = 12352
# elements apart, each holding INNER = 32 norm rows (heads) of N contiguous elements; out is contiguous.
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def gated_rms_norm(x_ptr, z_ptr, w_ptr, out_ptr, n0, N: tl.constexpr,
                   INNER: tl.constexpr, X_STRIDE: tl.constexpr, Z_STRIDE: tl.constexpr, EPS: tl.constexpr,
                   BLOCK: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
    if PDL:
        gdc_wait()   # earlier kernels' writes are visible from here on
    p = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    rm = p < n0 * INNER
    cols = tl.arange(0, BLOCK)
    cm = cols < N
    m = rm[:, None] & cm[None, :]
    xo = ((p // INNER) * X_STRIDE + (p % INNER) * N)[:, None] + cols[None, :]
    zo = ((p // INNER) * Z_STRIDE + (p % INNER) * N)[:, None] + cols[None, :]
    x = tl.load(x_ptr + xo, mask=m, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + zo, mask=m, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cm, other=0.0).to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(x * x, axis=1) / N + EPS)
    n = (x * inv[:, None]).to(out_ptr.dtype.element_ty).to(tl.float32)
    nw = (n * w[None, :]).to(out_ptr.dtype.element_ty).to(tl.float32)
    out = nw * (z / (1.0 + tl.exp(-z)))
    tl.store(out_ptr + (p * N)[:, None] + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=m)


META = {
    "entry": "gated_rms_norm",
    "params": [["x_ptr", "*bf16", "in:0"], ["z_ptr", "*bf16", "in:1"],
               ["w_ptr", "*bf16", "in:2"], ["out_ptr", "*bf16", "out:0"], ["n0", "i32", "dim:T"]],
    "constexprs": {"N": 128, "INNER": 32, "X_STRIDE": 4096,
                   "Z_STRIDE": 12352, "EPS": 1e-06, "BLOCK": 128, "ROWS": 16, "PDL": True},
    "pdl": True,
    "grid": ["cdiv(T * 32, 16)", 1, 1],
    "num_warps": 4,
    "num_stages": 1,
}
