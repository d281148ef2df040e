# latent_prologue: for token t at position p = positions[t] (one program a token),
#   q[t, h]  = [q_lat[t, h] | rope(q_pe[t, h], p)]                     H=64 heads, Dc=512, Dr=64
#   kv[t]    = [rms_norm(c_kv, kv_norm) | rope(k_pe, p)]                c_kv, k_pe = kv_a[t, :Dc], kv_a[t, Dc:]
# the five launches it replaces, in their roundings: the norm as rms_norm (normalized x rounded, then times the weight),
# eps=1e-06; the ropes as rope:
# rope(x, p) on the first R=64 dims (interleaved, GPT-J / Cohere: x1, x2 = x[0:R:2], x[1:R:2], the
#   pairs (x[2j], x[2j+1]); x[R:] passes through): out[2j] = x1 cos - x2 sin, out[2j+1] = x2 cos + x1 sin,  cos/sin of a_j = f32(p) * f32(inv_freq_j) times attention_factor,
#   inv_freq_j = theta^(-2j/R) (theta=50000.0), computed in fp64 in the kernel, then YaRN-blended
#   with inv_freq / factor by a linear ramp between the beta_fast/beta_slow correction dims (HF's _compute_yarn_parameters),
#   from the absolute position (no table, so no position limit); the angle is reduced mod 2 pi
#   (two-constant Cody-Waite) before cos/sin, so cos/sin of the fp32 angle stay accurate at any
#   position (no reliance on the hardware's range reduction).
# Inputs are read in place: q_lat rows 32768, q_pe rows 12288, kv_a rows 576 elements apart
# (column slices of the fused q / kv_a projection); q and kv are written contiguous.
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def latent_prologue(ql_ptr, qp_ptr, kva_ptr, w_ptr, q_ptr, kv_ptr, pos_ptr,
                    H: tl.constexpr, DC: tl.constexpr, DR: tl.constexpr, D: tl.constexpr,
                    QL_STRIDE: tl.constexpr, QP_STRIDE: tl.constexpr, KV_STRIDE: tl.constexpr,
                    BLOCK_H: tl.constexpr, BLOCK_DC: tl.constexpr, HALF: tl.constexpr,
                    BLOCK_HALF: tl.constexpr, PASS: tl.constexpr, BLOCK_PASS: tl.constexpr,
                    EPS: tl.constexpr, THETA: tl.constexpr, ROT: tl.constexpr, FACTOR: tl.constexpr, OLD_LEN: tl.constexpr, BETA_FAST: tl.constexpr, BETA_SLOW: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
    if PDL:
        gdc_wait()   # earlier kernels' writes are visible from here on
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_HALF)
    jm = (j < HALF)[None, :]
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
    # get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim), get_mscale(s, m) = 0.1 m ln(s) + 1
    ln_f = tl.log(tl.full([], FACTOR, tl.float64))
    att = ((0.1 * 1.0 * ln_f + 1.0) / (0.1 * 1.0 * ln_f + 1.0)).to(tl.float32)
    freq = freq.to(tl.float32)
    pos = tl.load(pos_ptr + t).to(tl.float32)
    ang = pos * freq
    # reduce mod 2 pi: C1 + C2 = 2 pi to ~1e-15; k * C1 is exact in the fma
    k2pi = tl.floor(ang * 0.15915493667125702 + 0.5)
    r = tl.fma(k2pi, -6.2831854820251465, ang)
    r = tl.fma(k2pi, 1.7484555314695172e-07, r)
    cos = (tl.cos(r) * att)[None, :]
    sin = (tl.sin(r) * att)[None, :]


    # kv[t, :Dc] = rms_norm(c_kv)
    c = tl.arange(0, BLOCK_DC)
    cm = c < DC
    x = tl.load(kva_ptr + t * KV_STRIDE + c, mask=cm, other=0.0).to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(x * x, axis=0) / DC + EPS)
    w = tl.load(w_ptr + c, mask=cm, other=0.0).to(tl.float32)
    n = (x * inv).to(kva_ptr.dtype.element_ty).to(tl.float32)
    tl.store(kv_ptr + t * D + c, (n * w).to(kv_ptr.dtype.element_ty), mask=cm)

    # kv[t, Dc:] = rope(k_pe), one head: [1, BLOCK_HALF] pairs
    ksrc = kva_ptr + t * KV_STRIDE + DC + 2 * j[None, :]
    k1 = tl.load(ksrc, mask=jm, other=0.0).to(tl.float32)
    k2 = tl.load(ksrc + 1, mask=jm, other=0.0).to(tl.float32)
    kdst = kv_ptr + t * D + DC + 2 * j[None, :]
    tl.store(kdst, (k1 * cos - k2 * sin).to(kv_ptr.dtype.element_ty), mask=jm)
    tl.store(kdst + 1, (k2 * cos + k1 * sin).to(kv_ptr.dtype.element_ty), mask=jm)

    # q[t, h, :Dc] = q_lat[t, h]
    h = tl.arange(0, BLOCK_H)
    hm = (h < H)[:, None]
    ql = tl.load(ql_ptr + t * QL_STRIDE + h[:, None] * DC + c[None, :], mask=hm & cm[None, :], other=0.0)
    tl.store(q_ptr + t * (H * D) + h[:, None] * D + c[None, :], ql.to(q_ptr.dtype.element_ty),
             mask=hm & cm[None, :])

    # q[t, h, Dc:] = rope(q_pe[t, h])
    qm = hm & jm
    qsrc = qp_ptr + t * QP_STRIDE + h[:, None] * DR + 2 * j[None, :]
    q1 = tl.load(qsrc, mask=qm, other=0.0).to(tl.float32)
    q2 = tl.load(qsrc + 1, mask=qm, other=0.0).to(tl.float32)
    qdst = q_ptr + t * (H * D) + h[:, None] * D + DC + 2 * j[None, :]
    tl.store(qdst, (q1 * cos - q2 * sin).to(q_ptr.dtype.element_ty), mask=qm)
    tl.store(qdst + 1, (q2 * cos + q1 * sin).to(q_ptr.dtype.element_ty), mask=qm)


META = {
    "entry": "latent_prologue",
    "params": [
        ["ql_ptr", "*bf16", "in:0"],
        ["qp_ptr", "*bf16", "in:1"],
        ["kva_ptr", "*bf16", "in:2"],
        ["w_ptr", "*bf16", "in:3"],
        ["q_ptr", "*bf16", "out:0"],
        ["kv_ptr", "*bf16", "out:1"],
        ["pos_ptr", "*i32", "meta:positions"],
    ],
    "constexprs": {"H": 64, "DC": 512, "DR": 64, "D": 576, "QL_STRIDE": 32768,
                   "QP_STRIDE": 12288, "KV_STRIDE": 576, "BLOCK_H": 64,
                   "BLOCK_DC": 512, "HALF": 32, "BLOCK_HALF": 32,
                   "PASS": 0, "BLOCK_PASS": 1, "EPS": 1e-06,
                   "THETA": 50000.0, "ROT": 64, "FACTOR": 32.0, "OLD_LEN": 4096.0,
                   "BETA_FAST": 1.0, "BETA_SLOW": 1.0, "PDL": True},
    "pdl": True,
    "grid": ["T", 1, 1],
    "num_warps": 4,
    "num_stages": 1,
}
