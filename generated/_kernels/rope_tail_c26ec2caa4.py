# rope_tail: x [T, H=64, D=512] (token rows 32768 elements apart) -> out [T, H, D] contiguous.
# DeepSeek-V4's RoPE (compiler/ops/compressed_attention.py): the LAST R=64 dims of each head rotate as
#   interleaved pairs (x[P + 2j], x[P + 2j + 1]), P = D - R = 448 (the first P dims pass through):
#   out[P + 2j] = x1 cos - x2 s sin, out[P + 2j + 1] = x2 cos + x1 s sin, s = -1.0 (inverse: the angle negated),
#   cos/sin of a_j = f32(p) * f32(inv_freq_j) times attention_factor, p = positions[t],
#   inv_freq from theta=160000 over R dims (yarn), as rope.py.j2 computes it.
# Grid: (cdiv(T, BLOCK_T), cdiv(H, BLOCK_H)); a program rotates BLOCK_H=4 heads of BLOCK_T=4 tokens.
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def rope_tail(x_ptr, o_ptr, pos_ptr, T,
              H: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
              PASS: tl.constexpr, BLOCK_PASS: tl.constexpr, X_STRIDE: tl.constexpr, SIGN: tl.constexpr,
              BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, THETA: tl.constexpr, ROT: tl.constexpr, FACTOR: tl.constexpr, OLD_LEN: tl.constexpr, BETA_FAST: tl.constexpr, BETA_SLOW: tl.constexpr, PDL: tl.constexpr):
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
    # HF's yarn: correction dims d(b) = R ln(old_len / (2 pi b)) / (2 ln theta) for b = beta_fast,
    # beta_slow floored / ceiled, clamped to [0, R - 1]; ramp_j = clamp((j - lo) / (hi - lo), 0, 1);
    # inv_freq_j = inv_freq_j / factor * ramp_j + inv_freq_j * (1 - ramp_j)
    two_ln_theta = 2.0 * tl.log(tl.full([], THETA, tl.float64))
    lo = ROT * tl.log(tl.full([], OLD_LEN / (BETA_FAST * 6.283185307179586), tl.float64)) / two_ln_theta
    hi = ROT * tl.log(tl.full([], OLD_LEN / (BETA_SLOW * 6.283185307179586), tl.float64)) / two_ln_theta
    lo = tl.floor(lo)
    hi = tl.ceil(hi)
    lo = tl.maximum(lo, 0.0)
    hi = tl.minimum(hi, ROT - 1.0)
    hi = tl.where(lo == hi, hi + 0.001, hi)                      # HF's zero-width guard
    ramp = tl.minimum(tl.maximum((j.to(tl.float64) - lo) / (hi - lo), 0.0), 1.0)
    freq = (freq / FACTOR) * ramp + freq * (1.0 - ramp)
    # attention_factor (multiplies cos and sin):
    att = 1.0                      # given
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
        cos = (tl.cos(r) * att)[None, :]
        sin = (tl.sin(r) * att)[None, :]

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
                   "SIGN": -1.0, "BLOCK_H": 4, "BLOCK_T": 4,
                   "THETA": 160000.0, "ROT": 64, "FACTOR": 16.0, "OLD_LEN": 65536.0,
                   "BETA_FAST": 32.0, "BETA_SLOW": 1.0, "PDL": True},
    "pdl": True,
    "grid": ["cdiv(T, 4)", 16, 1],
    "num_warps": 2,
    "num_stages": 1,
}
