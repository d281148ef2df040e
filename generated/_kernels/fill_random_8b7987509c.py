# fill_random (--load-format dummy), called by the runtime once per weight region before the
# first step, outside the plan's programs. Parameters, in order:
#   out_ptr  i32 [N]  out:0       one weight (or a 2^30-element chunk of one)
#   N        i32        dim:N       elements to write
#   period   i32        arg:period  out = (i % period) // div: for each [K] row of group indices,
#   div      i32        arg:div     column k's group k // block_k (a valid w_gidx)
# Mode index (compiler/contract/weight_roles.py FILL_KINDS): round floors the value (integer
# zero points); bytes stores a >> 24, a uniform byte (every u8 / u4 / e2m1 code is valid); e4m3
# the same with the NaN codes 0x7f / 0xff made 0x7e / 0xfe (+-448); index stores the group
# formula above and no random value.
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
def fill_random(out_ptr, N, period, div, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    i = pid * BLOCK + tl.arange(0, BLOCK)          # i < 2^30: the host splits larger weights
    tl.store(out_ptr + i, (i % period) // div, mask=i < N)


META = {
    "entry": "fill_random",
    "params": [["out_ptr", "*i32", "out:0"], ["N", "i32", "dim:N"], ["period", "i32", "arg:period"],
               ["div", "i32", "arg:div"]],
    "constexprs": {"BLOCK": 1024},
    "grid": ["cdiv(N, 1024)", 1, 1],
    "num_warps": 4,
    "num_stages": 1,
}
