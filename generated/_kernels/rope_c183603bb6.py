# rope: x [T, H=8, D=128] (token rows 10240 elements apart, a column slice of a wider buffer)
#   -> out [T, H, D] contiguous, each head rotated at its token's position p = positions[t]:
# rope(x, p) on the first R=128 dims (interleaved, GPT-J / Cohere: x1, x2 = x[0:R:2], x[1:R:2], the
#   pairs (x[2j], x[2j+1]); x[R:] passes through): out[2j] = x1 cos - x2 sin, out[2j+1] = x2 cos + x1 sin,  cos/sin of a_j = f32(p) * f32(inv_freq_j),
#   inv_freq_j = theta^(-2j/R) (theta=500000), computed in fp64 in the kernel,
#   from the absolute position (no table, so no position limit); the angle is reduced mod 2 pi
#   (two-constant Cody-Waite) before cos/sin, so cos/sin of the fp32 angle stay accurate at any
#   position (no reliance on the hardware's range reduction).
# Grid: (cdiv(T, BLOCK_T), cdiv(H, BLOCK_H)); a program rotates BLOCK_H=2 heads of BLOCK_T=1
# consecutive tokens, so inv_freq is computed once per BLOCK_T tokens. All other math in fp32.
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def rope(x_ptr, o_ptr, pos_ptr, T,
         H: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
         PASS: tl.constexpr, BLOCK_PASS: tl.constexpr, X_STRIDE: tl.constexpr,
         BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, THETA: tl.constexpr, ROT: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
    if PDL:
        gdc_wait()   # earlier kernels' writes are visible from here on
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    j = tl.arange(0, BLOCK_HALF)
    hm = h < H
    m2 = hm[:, None] & (j < HALF)[None, :]
    # inv_freq in fp64 (as the reference computes it), rounded to fp32; once per program
    log2_theta = tl.log2(tl.full([], THETA, tl.float64))
    freq = tl.exp2(j.to(tl.float64) * (log2_theta * tl.full([], -2.0 / ROT, tl.float64)))
    freq = freq.to(tl.float32)

    for i in range(BLOCK_T):
        t = tl.program_id(0).to(tl.int64) * BLOCK_T + i
        # rows past T (the last program's tail) compute on row T - 1 and store nothing
        t_ok = (tl.zeros([BLOCK_H], tl.int64) + t) < T           # a tensor compare: the interpreter
        tc = tl.minimum(t, T - 1)                                 # mis-types tensor & scalar bools
        src = x_ptr + tc * X_STRIDE + h[:, None] * D + 2 * j[None, :]
        x1 = tl.load(src, mask=m2, other=0.0).to(tl.float32)
        x2 = tl.load(src + 1, mask=m2, other=0.0).to(tl.float32)
        pos = tl.load(pos_ptr + tc).to(tl.float32)
        ang = pos * freq
        # reduce mod 2 pi: C1 + C2 = 2 pi to ~1e-15; k * C1 is exact in the fma
        k2pi = tl.floor(ang * 0.15915493667125702 + 0.5)
        r = tl.fma(k2pi, -6.2831854820251465, ang)
        r = tl.fma(k2pi, 1.7484555314695172e-07, r)
        cos = tl.cos(r)[None, :]
        sin = tl.sin(r)[None, :]

        dst = o_ptr + tc * (H * D) + h[:, None] * D + 2 * j[None, :]
        om = m2 & t_ok[:, None]
        tl.store(dst, (x1 * cos - x2 * sin).to(o_ptr.dtype.element_ty), mask=om)
        tl.store(dst + 1, (x2 * cos + x1 * sin).to(o_ptr.dtype.element_ty), mask=om)


META = {
    "entry": "rope",
    "params": [
        ["x_ptr", "*bf16", "in:0"],
        ["o_ptr", "*bf16", "out:0"],
        ["pos_ptr", "*i32", "meta:positions"],
        ["T", "i32", "dim:T"],
    ],
    "constexprs": {"H": 8, "D": 128, "HALF": 64, "BLOCK_HALF": 64,
                   "PASS": 0, "BLOCK_PASS": 1, "X_STRIDE": 10240,
                   "BLOCK_H": 2, "BLOCK_T": 1,
                   "THETA": 500000.0, "ROT": 128, "PDL": True},
    "pdl": True,
    "grid": ["cdiv(T, 1)", 4, 1],
    "num_warps": 1,
    "num_stages": 1,
}
