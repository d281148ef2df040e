   # head_linear: y[t, h, n] = sum_k x[t, h, k] w[h, n, k], H=32, N=128, K=256, rows T.
# Grid (cdiv(T, BLOCK_M=16), H, cdiv(N, BLOCK_N=64)): one program per
# (row block, head, N block) accumulates x[rows, h, :] @ w[h, ns, :]^T in fp32 over K in
# BLOCK_K=64 steps and rounds once to the output dtype. x's rows are X_STRIDE=8192 elements
# apart (a slice of a fused projection's output reads in place).
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def head_linear(x_ptr, w_ptr, y_ptr, R,
                H: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                X_STRIDE: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
    if PDL:
        gdc_wait()   # earlier kernels' writes are visible from here on
    pm = tl.program_id(0)
    h = tl.program_id(1)
    pn = tl.program_id(2)
    m = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    mm = m < R
    nm = n < N
    x_rows = m.to(tl.int64) * X_STRIDE + h * K
    w_rows = (h * N + n).to(tl.int64) * K
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        km = k < K
        x = tl.load(x_ptr + x_rows[:, None] + k[None, :], mask=mm[:, None] & km[None, :], other=0.0)
        w = tl.load(w_ptr + w_rows[:, None] + k[None, :], mask=nm[:, None] & km[None, :], other=0.0)
        if DOT_F32:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        else:
            w = w.to(x.dtype)
        acc += tl.dot(x, tl.trans(w))
    y_off = ((m.to(tl.int64) * H + h) * N)[:, None] + n[None, :]
    tl.store(y_ptr + y_off, acc.to(y_ptr.dtype.element_ty), mask=mm[:, None] & nm[None, :])

META = {
    "entry": "head_linear",
    "params": [
        ["x_ptr", "*bf16", "in:0"],
        ["w_ptr", "*bf16", "in:1"],
        ["y_ptr", "*bf16", "out:0"],
        ["R", "i32", "dim:T"],
    ],
    "constexprs": {"H": 32, "N": 128, "K": 256, "BLOCK_M": 16,
                   "BLOCK_N": 64, "BLOCK_K": 64, "X_STRIDE": 8192,
                   "DOT_F32": False, "PDL": True},
    "pdl": True,
    "grid": ["cdiv(T, 16)", "32", "cdiv(128, 64)"],
    "num_warps": 4,
    "num_stages": 2,
}
