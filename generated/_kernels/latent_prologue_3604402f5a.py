# latent_prologue: for token t at position p = positions[t] (one program a token),
#   q[t, h]  = [q_lat[t, h] | rope(q_pe[t, h], p)]                     H=20 heads, Dc=512, Dr=64
#   kv[t]    = [rms_norm(c_kv, kv_norm) | rope(k_pe, p)]                c_kv, k_pe = kv_a[t, :Dc], kv_a[t, Dc:]
# the five launches it replaces, in their roundings: the norm as rms_norm (normalized x rounded, then times the weight),
# eps=1e-06; the ropes as rope:
# rope(x, p) on the first R=64 dims (interleaved, GPT-J / Cohere: x1, x2 = x[0:R:2], x[1:R:2], the
#   pairs (x[2j], x[2j+1]); x[R:] passes through): out[2j] = x1 cos - x2 sin, out[2j+1] = x2 cos + x1 sin,  cos/sin of a_j = f32(p) * f32(inv_freq_j),
#   inv_freq_j = theta^(-2j/R) (theta=1000000.0), computed in fp64 in the kernel,
#   from the absolute position (no table, so no position limit); the angle is reduced mod 2 pi
#   (two-constant Cody-Waite) before cos/sin, so cos/sin of the fp32 angle stay accurate at any
#   position (no reliance on the hardware's range reduction).
# Inputs are read in place: q_lat rows 10240, q_pe rows 5120, kv_a rows 1344 elements apart
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
                    EPS: tl.constexpr, THETA: tl.constexpr, ROT: tl.constexpr, PDL: tl.constexpr):
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
    freq = freq.to(tl.float32)
    pos = tl.load(pos_ptr + t).to(tl.float32)
    ang = pos * freq
    # reduce mod 2 pi: C1 + C2 = 2 pi to ~1e-15; k * C1 is exact in the fma
    k2pi = tl.floor(ang * 0.15915493667125702 + 0.5)
    r = tl.fma(k2pi, -6.2831854820251465, ang)
    r = tl.fma(k2pi, 1.7484555314695172e-07, r)
    cos = tl.cos(r)[None, :]
    sin = tl.sin(r)[None, :]


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
    "constexprs": {"H": 20, "DC": 512, "DR": 64, "D": 576, "QL_STRIDE": 10240,
                   "QP_STRIDE": 5120, "KV_STRIDE": 1344, "BLOCK_H": 32,
                   "BLOCK_DC": 512, "HALF": 32, "BLOCK_HALF": 32,
                   "PASS": 0, "BLOCK_PASS": 1, "EPS": 1e-06,
                   "THETA": 1000000.0, "ROT": 64, "PDL": True},
    "pdl": True,
    "grid": ["T", 1, 1],
    "num_warps": 4,
    "num_stages": 1,
}
