# qk_norm_rope_cache: qkv [T, (Hq + 2 Hkv) D] = [q | k | v] with Hq=32, Hkv=2, D=256;
# q -> out:0 [T, Hq, D];
# for a token t at position p = positions[t] and slot s = slot_mapping[t]:
#   q[t, h]   = rope(rms_norm(q_h, q_norm), p)
#   K[s, kh]  = rope(rms_norm(k_kh, k_norm), p)                -> cache:k [pages, page_size, Hkv, D]
#   V[s, kh]  = v_kh                                                     -> cache:v
# rms_norm(x, w) = bf16(x / sqrt(mean(x^2) + eps) * w) (eps=1e-06) over all D dims: the f32 weight
# multiplies in fp32 and the product is rounded once.
# rope(x, p) on the first R=64 dims (rotate-half; x1, x2 the two halves of x[:R]; x[R:] passes through):
#   [x1 cos - x2 sin, x2 cos + x1 sin, x[R:]],  cos/sin of a_j = f32(p) * f32(inv_freq_j),
#   inv_freq_j = theta^(-2j/R) (theta=10000000), computed in fp64 in the kernel,
#   from the absolute position (no table, so no position limit); the angle is reduced mod 2 pi
#   (two-constant Cody-Waite) before cos/sin, so cos/sin of the fp32 angle stay accurate at any
#   position (no reliance on the hardware's range reduction).
# A slot < 0 (padding rows) writes nothing to the cache.
# Grid: (cdiv(T, BLOCK_T), cdiv(Hq + Hkv, BLOCK_H)); a program handles BLOCK_H heads of the q|k
# head list (k heads also copy their v head) for BLOCK_T consecutive tokens, so the fp64
# inv_freq is computed once per BLOCK_T tokens. All other math in fp32.
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def qk_norm_rope_cache(qkv_ptr, qn_ptr, kn_ptr, q_ptr, k_cache, v_cache, pos_ptr, slot_ptr, T,
                       HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr,
                       HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, PASS: tl.constexpr, BLOCK_PASS: tl.constexpr, EPS: tl.constexpr, THETA: tl.constexpr, ROT: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
    if PDL:
        gdc_wait()   # earlier kernels' writes are visible from here on
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)       # index into [q heads | k heads]
    hm = h < HQ + HKV
    is_q = h < HQ
    j = tl.arange(0, BLOCK_HALF)
    j_ok = j < HALF
    m2 = hm[:, None] & j_ok[None, :]
    W: tl.constexpr = 17408
    # inv_freq in fp64 (as the reference computes it), rounded to fp32; once per program
    log2_theta = tl.log2(tl.full([], THETA, tl.float64))
    freq = tl.exp2(j.to(tl.float64) * (log2_theta * tl.full([], -2.0 / ROT, tl.float64)))
    freq = freq.to(tl.float32)
    # dims R..D-1: normed, not rotated
    pj = 2 * HALF + tl.arange(0, BLOCK_PASS)
    pm = hm[:, None] & (pj < D)[None, :]
    qw1 = tl.load(qn_ptr + j, mask=j_ok, other=0.0).to(tl.float32)
    qw2 = tl.load(qn_ptr + HALF + j, mask=j_ok, other=0.0).to(tl.float32)
    qwp = tl.load(qn_ptr + pj, mask=pj < D, other=0.0).to(tl.float32)
    kw1 = tl.load(kn_ptr + j, mask=j_ok, other=0.0).to(tl.float32)
    kw2 = tl.load(kn_ptr + HALF + j, mask=j_ok, other=0.0).to(tl.float32)
    kwp = tl.load(kn_ptr + pj, mask=pj < D, other=0.0).to(tl.float32)
    w1 = tl.where(is_q[:, None], qw1[None, :], kw1[None, :])
    w2 = tl.where(is_q[:, None], qw2[None, :], kw2[None, :])
    wp = tl.where(is_q[:, None], qwp[None, :], kwp[None, :])
    normed = hm

    for i in range(BLOCK_T):
        t = tl.program_id(0).to(tl.int64) * BLOCK_T + i
        # rows past T (the last program's tail) compute on row T - 1 and store nothing
        t_ok = (tl.zeros([BLOCK_H], tl.int64) + t) < T           # a tensor compare: the interpreter
        tc = tl.minimum(t, T - 1)                                 # mis-types tensor & scalar bools
        # every load comes before the first store (a load after a store waits for it: the compiler cannot
        # tell the pointers apart); q and k heads are consecutive D-wide column groups of the qkv row, each
        # k head's v head Hkv heads further on
        src = qkv_ptr + tc * W + h[:, None] * D + j[None, :]
        x1 = tl.load(src, mask=m2, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=m2, other=0.0).to(tl.float32)
        is_k = hm & ~is_q & t_ok
        v1 = tl.load(src + HKV * D, mask=m2 & is_k[:, None], other=0.0)
        v2 = tl.load(src + HKV * D + HALF, mask=m2 & is_k[:, None], other=0.0)
        srcp = qkv_ptr + tc * W + h[:, None] * D + pj[None, :]
        xp = tl.load(srcp, mask=pm, other=0.0).to(tl.float32)
        vp = tl.load(srcp + HKV * D, mask=pm & is_k[:, None], other=0.0)
        pos = tl.load(pos_ptr + tc).to(tl.float32)
        slot = tl.load(slot_ptr + tc).to(tl.int64)
        ang = pos * freq
        # reduce mod 2 pi: C1 + C2 = 2 pi to ~1e-15; k * C1 is exact in the fma
        k2pi = tl.floor(ang * 0.15915493667125702 + 0.5)
        r = tl.fma(k2pi, -6.2831854820251465, ang)
        r = tl.fma(k2pi, 1.7484555314695172e-07, r)
        cos = tl.cos(r)[None, :]
        sin = tl.sin(r)[None, :]
        # per-head RMSNorm, the normed value rounded to bf16 (what the model feeds to rope)
        rstd = tl.math.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1) + tl.sum(xp * xp, 1)) / D + EPS)
        npass = (xp * rstd[:, None] * wp).to(qkv_ptr.dtype.element_ty).to(tl.float32)
        xp = tl.where(normed[:, None], npass, xp)
        n1 = (x1 * rstd[:, None] * w1).to(qkv_ptr.dtype.element_ty).to(tl.float32)
        n2 = (x2 * rstd[:, None] * w2).to(qkv_ptr.dtype.element_ty).to(tl.float32)
        x1 = tl.where(normed[:, None], n1, x1)
        x2 = tl.where(normed[:, None], n2, x2)
        o1 = x1 * cos - x2 * sin
        o2 = x2 * cos + x1 * sin

        # q heads -> q[t, h, :]
        dst_q = q_ptr + tc * (HQ * D) + h[:, None] * D + j[None, :]
        qm = m2 & (is_q & t_ok)[:, None]
        tl.store(dst_q, o1.to(q_ptr.dtype.element_ty), mask=qm)
        tl.store(dst_q + HALF, o2.to(q_ptr.dtype.element_ty), mask=qm)

        # k heads -> K cache at the token's slot; v heads (Hkv columns further on) -> V cache
        kh = h - HQ
        k_ok = is_k & (tl.zeros([BLOCK_H], tl.int64) + slot >= 0)
        km = m2 & k_ok[:, None]
        dst_k = k_cache + slot * (HKV * D) + kh[:, None] * D + j[None, :]
        tl.store(dst_k, o1.to(k_cache.dtype.element_ty), mask=km)
        tl.store(dst_k + HALF, o2.to(k_cache.dtype.element_ty), mask=km)
        dst_v = v_cache + slot * (HKV * D) + kh[:, None] * D + j[None, :]
        tl.store(dst_v, v1.to(v_cache.dtype.element_ty), mask=km)
        tl.store(dst_v + HALF, v2.to(v_cache.dtype.element_ty), mask=km)
        # the pass-through dims: q, K (normed, unrotated) and V
        qpm = pm & (is_q & t_ok)[:, None]
        tl.store(q_ptr + tc * (HQ * D) + h[:, None] * D + pj[None, :], xp.to(q_ptr.dtype.element_ty), mask=qpm)
        kpm = pm & k_ok[:, None]
        dst_kp = slot * (HKV * D) + kh[:, None] * D + pj[None, :]
        tl.store(k_cache + dst_kp, xp.to(k_cache.dtype.element_ty), mask=kpm)
        tl.store(v_cache + dst_kp, vp.to(v_cache.dtype.element_ty), mask=kpm)


META = {
    "entry": "qk_norm_rope_cache",
    "params": [
        ["qkv_ptr", "*bf16", "in:0"],
        ["qn_ptr", "*fp32", "in:1"],
        ["kn_ptr", "*fp32", "in:2"],
        ["q_ptr", "*bf16", "out:0"],
        ["k_cache", "*bf16", "cache:k"],
        ["v_cache", "*bf16", "cache:v"],
        ["pos_ptr", "*i32", "meta:positions"],
        ["slot_ptr", "*i32", "meta:slot_mapping"],
        ["T", "i32", "dim:T"],
    ],
    "constexprs": {"HQ": 32, "HKV": 2, "D": 256,
                   "BLOCK_H": 4, "BLOCK_T": 4, "HALF": 32, "BLOCK_HALF": 32, "PASS": 192, "BLOCK_PASS": 256,
                   "EPS": 1e-06, "THETA": 10000000.0, "ROT": 64,
                   "PDL": True},
    "pdl": True,
    "grid": ["cdiv(T, 4)", 9, 1],
    "num_warps": 2,
    "num_stages": 1,
}
