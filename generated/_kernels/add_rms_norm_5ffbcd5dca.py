# add_rms_norm over rows of x [T, 7168] (bf16), w bf16, fp32 math, in HF's order:
#   s = round(x + delta)                          -> out:0, written over x (the residual stream)
#   h = round(round(s * rsqrt(mean(s^2) + eps)) * w)   -> out:1
# where round() is the cast to the activation dtype: HF adds the residual in bf16, and its
# RMSNorm normalizes in fp32, casts to bf16, then multiplies by the bf16 weight (Llama's order).
#   codes = e4m3(h / s), s = amax(|h|) / 448 per group of 128 columns (1 where 0)  -> out:2, scales -> out:3
# (triton/_act_codes.j2): the fp8 linear after it reads them instead of quantizing h in every
# program; a last pass over the row, h read back as stored (bf16: what the linear quantized).
# One program per row. The row lives in registers when it fits one BLOCK; otherwise a first
# pass stores s and sums s^2 chunk by chunk, and a second pass reads s back (exact: it is the
# rounded value) to normalize. res_ptr and x_ptr are the same buffer: each element is read
# before the same program overwrites it, and no other program touches the row.
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _act_scale(amax):
    """A group's scale: amax / 448, 1 where the group is all zeros."""
    return tl.where(amax > 0, tl.math.div_rn(amax, 448.0), 1.0)


@triton.jit
def _act_store(codes_ptr, x, s, offs, mask):
    """e4m3(x / s) at offs (x fp32, s broadcastable to it)."""
    tl.store(codes_ptr + offs, tl.math.div_rn(x, s).to(tl.float8e4nv), mask=mask)


@triton.jit
def add_rms_norm(x_ptr, d_ptr, w_ptr, res_ptr, h_ptr, codes_ptr, scale_ptr, H: tl.constexpr, EPS: tl.constexpr,
                 BLOCK: tl.constexpr, CHUNKS: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
    if PDL:
        gdc_wait()   # earlier kernels' writes are visible from here on
    row = tl.program_id(0).to(tl.int64) * H
    cols = tl.arange(0, BLOCK)
    if CHUNKS == 1:
        mask = cols < H
        x = tl.load(x_ptr + row + cols, mask=mask, other=0.0).to(tl.float32)
        d = tl.load(d_ptr + row + cols, mask=mask, other=0.0).to(tl.float32)
        s = (x + d).to(res_ptr.dtype.element_ty)
        tl.store(res_ptr + row + cols, s, mask=mask)
        s = s.to(tl.float32)
        inv = tl.math.rsqrt(tl.sum(s * s, axis=0) / H + EPS)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        n = (s * inv).to(h_ptr.dtype.element_ty).to(tl.float32)
        tl.store(h_ptr + row + cols, (n * w).to(h_ptr.dtype.element_ty), mask=mask)
    else:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for c in range(CHUNKS):
            offs = c * BLOCK + cols
            mask = offs < H
            x = tl.load(x_ptr + row + offs, mask=mask, other=0.0).to(tl.float32)
            d = tl.load(d_ptr + row + offs, mask=mask, other=0.0).to(tl.float32)
            s = (x + d).to(res_ptr.dtype.element_ty)
            tl.store(res_ptr + row + offs, s, mask=mask)
            s = s.to(tl.float32)
            acc += s * s
        inv = tl.math.rsqrt(tl.sum(acc, axis=0) / H + EPS)
        tl.debug_barrier()   # the second pass reads s that other threads of the program stored
        for c in range(CHUNKS):
            offs = c * BLOCK + cols
            mask = offs < H
            s = tl.load(res_ptr + row + offs, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            n = (s * inv).to(h_ptr.dtype.element_ty).to(tl.float32)
            tl.store(h_ptr + row + offs, (n * w).to(h_ptr.dtype.element_ty), mask=mask)
    tl.debug_barrier()   # the codes pass reads h that other threads of the program stored
    # (names of its own: a name the norm's branches bound would be a loop-carried value of another type)
    for g0 in range(0, 56, 8):
        qg = g0 + tl.arange(0, 8)
        qk = qg[:, None] * 128 + tl.arange(0, 128)[None, :]
        qmask = (qg[:, None] < 56) & (qk < H)
        qx = tl.load(h_ptr + row + qk, mask=qmask, other=0.0).to(tl.float32)
        qs = _act_scale(tl.max(tl.abs(qx), axis=1))
        _act_store(codes_ptr, qx, qs[:, None], row + qk, qmask)
        tl.store(scale_ptr + tl.program_id(0).to(tl.int64) * 56 + qg, qs, mask=qg < 56)


META = {
    "entry": "add_rms_norm",
    "params": [["x_ptr", "*bf16", "in:0"], ["d_ptr", "*bf16", "in:1"],
               ["w_ptr", "*bf16", "in:2"], ["res_ptr", "*bf16", "out:0"],
               ["h_ptr", "*bf16", "out:1"], ["codes_ptr", "*fp8e4nv", "out:2"],
               ["scale_ptr", "*fp32", "out:3"]],
    "constexprs": {"H": 7168, "EPS": 1e-06, "BLOCK": 8192, "CHUNKS": 1, "PDL": True},
    "pdl": True,
    "grid": ["T", 1, 1],
    "num_warps": 8,
    "num_stages": 1,
}
