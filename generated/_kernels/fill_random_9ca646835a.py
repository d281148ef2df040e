# fill_random (--load-format dummy), called by the runtime once per weight region before the
# first step, outside the plan's programs. Parameters, in order:
#   out_ptr  bf16 [N]  out:0       one weight (or a 2^30-element chunk of one)
#   N        i32        dim:N       elements to write
#   seed     i32        arg:seed    per (weight, layer, chunk): runtime/dummy_weights.py seed_of
#   scale    f32        arg:scale   out = z * scale + offset
#   offset   f32        arg:offset
# Math: a counter-based hash, so any element is a function of (seed, index) alone and the
# numpy mirror (runtime/dummy_weights.py values) reproduces it:
#   a = mix(mix(i) ^ seed), b = mix(a + 0x9E3779B9)       mix: lowbias32, a 32-bit bijection
#   s = a.lo16 + a.hi16 + b.lo16 + b.hi16                  Irwin-Hall sum of 4 uniforms (exact int)
#   z = (s - 131070) * sqrt(3) / 65536                     mean 0, std 1, |z| <= 3.47 (no outliers
#                                                          that would blow activations up)
#   out = fma(z, scale, offset)                            one rounding, explicitly: the compiler
#                                                          would contract z * scale + offset anyway
# mix(i) first so that two seeds do not give shifted copies of one stream (i ^ s1 vs i ^ s2).
import triton
import triton.language as tl


@triton.jit
def _mix(x):
    # lowbias32 (C. Wellons): xor-shift-multiply rounds, bijective on uint32, full avalanche
    x ^= x >> 16
    x *= 0x7FEB352D
    x ^= x >> 15
    x *= 0x846CA68B
    x ^= x >> 16
    return x


@triton.jit
def fill_random(out_ptr, N, seed, scale, offset, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    i = pid * BLOCK + tl.arange(0, BLOCK)          # i < 2^30: the host splits larger weights
    a = _mix(_mix(i.to(tl.uint32)) ^ seed.to(tl.uint32))
    b = _mix(a + 0x9E3779B9)
    s = (a & 0xFFFF) + (a >> 16) + (b & 0xFFFF) + (b >> 16)
    z = (s.to(tl.int32) - 131070).to(tl.float32) * 2.6428997e-05    # sqrt(3) / 65536 in f32
    tl.store(out_ptr + i, tl.fma(z, scale, offset).to(out_ptr.dtype.element_ty), mask=i < N)


META = {
    "entry": "fill_random",
    "params": [["out_ptr", "*bf16", "out:0"], ["N", "i32", "dim:N"], ["seed", "i32", "arg:seed"],
               ["scale", "fp32", "arg:scale"], ["offset", "fp32", "arg:offset"]],
    "constexprs": {"BLOCK": 1024},
    "grid": ["cdiv(N, 1024)", 1, 1],
    "num_warps": 4,
    "num_stages": 1,
}
