# hc_mix (ops/hyper_connection.py): mix[t] = (x[t] @ fn^T) * rsqrt(mean(x[t]^2) + eps) over the K = 16384
# stream elements (N = 4, H = 4096) and M = 24 rows of fn, all in fp32 (CUDA cores: a tf32 dot
# would round the mix the Sinkhorn rounds then amplify). ROWS = 4 tokens a program, K in
# BLOCK_K = 64 slices.
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def hc_mix(x_ptr, fn_ptr, mix_ptr, T, K: tl.constexpr, M: tl.constexpr, MP: tl.constexpr, EPS: tl.constexpr,
           ROWS: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
    if PDL:
        gdc_wait()   # earlier kernels' writes are visible from here on
    t = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    ok = t < T
    m = tl.arange(0, MP)
    ss = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, MP], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        km = k < K
        x = tl.load(x_ptr + t[:, None] * K + k[None, :], mask=ok[:, None] & km[None, :], other=0.0).to(tl.float32)
        w = tl.load(fn_ptr + m[:, None] * K + k[None, :], mask=(m < M)[:, None] & km[None, :], other=0.0).to(tl.float32)
        ss += tl.sum(x * x, axis=1)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    mix = acc / tl.sqrt(ss / K + EPS)[:, None]
    tl.store(mix_ptr + t[:, None] * M + m[None, :], mix, mask=ok[:, None] & (m < M)[None, :])


META = {
    "entry": "hc_mix",
    "params": [["x_ptr", "*bf16", "in:0"], ["fn_ptr", "*fp32", "in:1"],
               ["mix_ptr", "*fp32", "out:0"], ["T", "i32", "dim:T"]],
    "constexprs": {"K": 16384, "M": 24, "MP": 32, "EPS": 1e-06, "ROWS": 4,
                   "BLOCK_K": 64, "PDL": True},
    "pdl": True,
    "grid": ["cdiv(T, 4)", 1, 1],
    "num_warps": 4,
    "num_stages": 1,
}
