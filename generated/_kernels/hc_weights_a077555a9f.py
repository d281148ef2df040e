# hc_weights (ops/hyper_connection.py): N = 4 streams, mix rows of M = 24, ROWS = 16 tokens a program.
# pre = sigmoid(mix_pre * scale[0] + base_pre) + eps, post = 2 sigmoid(mix_post * scale[1] + base_post),
# comb = softmax_k(mix_comb * scale[2] + base_comb) + eps, then 20 Sinkhorn rounds (the first the
# columns only), each tile [ROWS, N, N] in registers: the whole projection is (2 + N) N floats a token.
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def hc_weights(mix_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, T, N: tl.constexpr,
             NP: tl.constexpr, M: tl.constexpr, ITERS: tl.constexpr, EPS: tl.constexpr, ROWS: tl.constexpr,
             PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
    if PDL:
        gdc_wait()   # earlier kernels' writes are visible from here on
    t = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    ok = t < T
    n = tl.arange(0, NP)
    nm = n < N
    m2 = ok[:, None] & nm[None, :]
    row = mix_ptr + t[:, None] * M
    s = tl.load(scale_ptr).to(tl.float32)
    pre = _sigmoid(tl.load(row + n[None, :], mask=m2, other=0.0).to(tl.float32) * s
                   + tl.load(base_ptr + n, mask=nm, other=0.0).to(tl.float32)[None, :]) + EPS
    tl.store(pre_ptr + t[:, None] * N + n[None, :], pre, mask=m2)
    s = tl.load(scale_ptr + 1).to(tl.float32)
    post = 2.0 * _sigmoid(tl.load(row + N + n[None, :], mask=m2, other=0.0).to(tl.float32) * s
                          + tl.load(base_ptr + N + n, mask=nm, other=0.0).to(tl.float32)[None, :])
    tl.store(post_ptr + t[:, None] * N + n[None, :], post, mask=m2)
    # comb[t, j, k] at 2N + j N + k of the row
    j = n[None, :, None]
    k = n[None, None, :]
    jk = j * N + k
    inside = (j < N) & (k < N)
    m3 = ok[:, None, None] & inside
    s = tl.load(scale_ptr + 2).to(tl.float32)
    c = tl.load(mix_ptr + t[:, None, None] * M + 2 * N + jk, mask=m3, other=0.0).to(tl.float32) * s \
        + tl.load(base_ptr + 2 * N + jk, mask=inside, other=0.0).to(tl.float32)
    c = tl.where(inside, c, -1.0e30)                 # padding lanes out of the softmax (finite: no inf - inf)
    c = tl.exp(c - tl.max(c, axis=2)[:, :, None])
    c = tl.where(inside, c / tl.sum(c, axis=2)[:, :, None] + EPS, 0.0)
    c = c / (tl.sum(c, axis=1)[:, None, :] + EPS)
    for _ in range(ITERS - 1):
        c = c / (tl.sum(c, axis=2)[:, :, None] + EPS)
        c = c / (tl.sum(c, axis=1)[:, None, :] + EPS)
    tl.store(comb_ptr + t[:, None, None] * (N * N) + jk, c, mask=m3)


META = {
    "entry": "hc_weights",
    "params": [["mix_ptr", "*fp32", "in:0"], ["base_ptr", "*fp32", "in:1"],
               ["scale_ptr", "*fp32", "in:2"], ["pre_ptr", "*fp32", "out:0"],
               ["post_ptr", "*fp32", "out:1"], ["comb_ptr", "*fp32", "out:2"],
               ["T", "i32", "dim:T"]],
    "constexprs": {"N": 4, "NP": 4, "M": 24, "ITERS": 20, "EPS": 1e-06,
                   "ROWS": 16, "PDL": True},
    "pdl": True,
    "grid": ["cdiv(T, 16)", 1, 1],
    "num_warps": 4,
    "num_stages": 1,
}
