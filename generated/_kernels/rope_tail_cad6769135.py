# rope_tail: x [T, H=64, D=512] (token rows 32768 elements apart) -> out [T, H, D] contiguous.
# DeepSeek-V4's RoPE (compiler/ops/compressed_attention.py): the LAST R=64 dims of each head rotate as
#   interleaved pairs (x[P + 2j], x[P + 2j + 1]), P = D - R = 448 (the first P dims pass through):
#   out[P + 2j] = x1 cos - x2 s sin, out[P + 2j + 1] = x2 cos + x1 s sin, s = -1.0 (inverse: the angle negated),
#   cos/sin of a_j = f32(p) * f32(inv_freq_j), p = positions[t],
#   inv_freq from theta=10000 over R dims, as rope.py.j2 computes it.
# Grid: (cdiv(T, BLOCK_T), cdiv(H, BLOCK_H)); a program rotates BLOCK_H=2 heads of BLOCK_T=1 tokens.
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def rope_tail(x_ptr, o_ptr, pos_ptr, T,
              H: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
              PASS: tl.constexpr, BLOCK_PASS: tl.constexpr, X_STRIDE: tl.constexpr, SIGN: tl.constexpr,
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
    pj = tl.arange(0, BLOCK_PASS)
    pm = hm[:, None] & (pj < PASS)[None, :]

    for i in range(BLOCK_T):
        t = tl.program_id(0).to(tl.int64) * BLOCK_T + i
        t_ok = (tl.zeros([BLOCK_H], tl.int64) + t) < T
        tc = tl.minimum(t, T - 1)
        src = x_ptr + tc * X_STRIDE + h[:, None] * D + PASS + 2 * j[None, :]
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

        sin = sin * SIGN
        dst = o_ptr + tc * (H * D) + h[:, None] * D + PASS + 2 * j[None, :]
        om = m2 & t_ok[:, None]
        tl.store(dst, (x1 * cos - x2 * sin).to(o_ptr.dtype.element_ty), mask=om)
        tl.store(dst + 1, (x2 * cos + x1 * sin).to(o_ptr.dtype.element_ty), mask=om)
        rest = tl.load(x_ptr + tc * X_STRIDE + h[:, None] * D + pj[None, :], mask=pm, other=0.0)
        tl.store(o_ptr + tc * (H * D) + h[:, None] * D + pj[None, :],
                 rest.to(o_ptr.dtype.element_ty), mask=pm & t_ok[:, None])


META = {
    "entry": "rope_tail",
    "params": [
        ["x_ptr", "*bf16", "in:0"],
        ["o_ptr", "*bf16", "out:0"],
        ["pos_ptr", "*i32", "meta:positions"],
        ["T", "i32", "dim:T"],
    ],
    "constexprs": {"H": 64, "D": 512, "HALF": 32, "BLOCK_HALF": 32,
                   "PASS": 448, "BLOCK_PASS": 512, "X_STRIDE": 32768,
                   "SIGN": -1.0, "BLOCK_H": 2, "BLOCK_T": 1,
                   "THETA": 10000.0, "ROT": 64, "PDL": True},
    "pdl": True,
    "grid": ["cdiv(T, 1)", 32, 1],
    "num_warps": 1,
    "num_stages": 1,
}
