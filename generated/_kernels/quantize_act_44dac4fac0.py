# quantize_act: an fp8 linear's activations x [T, 8192] (bf16) made into e4m3 codes
#   [T, 8192] and f32 scales [T, 64], once a step for every launch that reads them
#   (dynamic_group, groups of 128 columns):
#   s = amax(|x|) / 448 over each group of a row (1 where it is all zeros), codes = e4m3(x / s).
#   (triton/_act_codes.j2: compiler/ops/quant.py's act_codes bit for bit.)
# Grid (rows, cdiv(groups, 8)): a program quantizes 8 groups of one row as one [8, 128] tile.
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
def quantize_act(x_ptr, codes_ptr, scale_ptr, K: tl.constexpr, G: tl.constexpr,
                 AG: tl.constexpr, CG: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
    if PDL:
        gdc_wait()   # earlier kernels' writes are visible from here on
    r = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * CG + tl.arange(0, CG)
    k = g[:, None] * AG + tl.arange(0, AG)[None, :]
    mask = (g[:, None] < G) & (k < K)
    x = tl.load(x_ptr + r * K + k, mask=mask, other=0.0).to(tl.float32)
    s = _act_scale(tl.max(tl.abs(x), axis=1))
    _act_store(codes_ptr, x, s[:, None], r * K + k, mask)
    tl.store(scale_ptr + r * G + g, s, mask=g < G)


META = {
    "entry": "quantize_act",
    "params": [["x_ptr", "*bf16", "in:0"], ["codes_ptr", "*fp8e4nv", "out:0"],
               ["scale_ptr", "*fp32", "out:1"]],
    "constexprs": {"K": 8192, "G": 64, "AG": 128, "CG": 8, "BLOCK": 4096, "PDL": True},
    "pdl": True,
    "grid": ["T", 8, 1],
    "num_warps": 4,
    "num_stages": 1,
}
