"""Ops that passes create: views that split fused weights' outputs (`split`, which specs may
write too: `q, k, v = split(conv, [Kd, Kd, Vd])`), and fused kernels.

Each fused op's reference is the composition of the spec ops it replaces, so a fusion pass is
correct exactly when the reference executor's logits do not move.
"""
import numpy as np

from .base import REQUIRED, expect, op, tt
from .rms_norm import rms


# split(x[rows, N], sizes) -> views x[:, a:b] for consecutive sizes (outputs of a fused linear, or
# a spec's split of one projection into parts): row-strided views, so x must be 2-D (its rows the
# tokens); view a part as [T, heads, D] afterwards.
def split_infer(types, attrs):
    (x,) = types
    sizes = attrs["sizes"]
    expect(isinstance(sizes, list) and sizes and all(isinstance(n, int) and not isinstance(n, bool)
                                                     and n > 0 for n in sizes),
           f"split sizes must be a list of positive integers, got {sizes!r}")
    expect(len(x.shape) == 2, f"split takes a 2-D x [rows, N] (its parts are row-strided views), "
                              f"got {x}: split before viewing the heads")
    expect(sum(sizes) == x.shape[-1], f"split sizes {sizes} do not sum to {x.shape[-1]}")
    return [tt(x.shape[:-1] + (n,), x.dtype) for n in attrs["sizes"]]


def split(ctx, x, sizes):
    cuts = np.cumsum([0] + list(sizes))
    return tuple(x[..., a:b] for a, b in zip(cuts[:-1], cuts[1:]))


op(name="split", tensors=["x"], attrs={"sizes": REQUIRED}, infer=split_infer, reference=split,
   n_outputs=None, view=True, doc="views of consecutive column ranges (as many as sizes)")


# fill_zero(like) -> zeros shaped like `like` (the first layer's pending residual delta).
op(name="fill_zero", tensors=["like"], infer=lambda types, attrs: [types[0]],
   reference=lambda ctx, like: np.zeros_like(like, dtype=np.float32), internal=True,
   templates={"triton": "fill_zero"}, doc="zeros")


# add_rms_norm(x, d, w) -> (x + d, rms_norm(x + d, w)); the sum overwrites x in place.
def add_rms_norm_infer(types, attrs):
    x, d, w = types
    expect(x.shape == d.shape, f"add_rms_norm operands differ: {x} vs {d}")
    return [x, x]


def add_rms_norm(ctx, x, d, w, eps):
    s = x + d
    return s, rms(s, w, eps)


op(name="add_rms_norm", tensors=["x", "delta", "weight"], attrs={"eps": REQUIRED},
   infer=add_rms_norm_infer, reference=add_rms_norm, n_outputs=2, inplace={0: 0},
   internal=True, templates={"triton": "add_rms_norm", "cuda": "add_rms_norm"},
   doc="residual add + RMSNorm")


# add_rms_norm_quant(x, d, w) -> (s, h, codes, a_scale): add_rms_norm, and h's e4m3 codes and
# per-row group scales as quantize_act makes them (attrs.act_quant: the fp8 linear's scheme that
# reads them; compiler/passes/act_codes.py). One program holds a whole row, so it quantizes it.
def add_rms_norm_quant_infer(types, attrs):
    from .quantize_act import infer as codes_infer
    x, _ = add_rms_norm_infer(types, attrs)
    return [x, x] + codes_infer([x], {"act_quant": attrs["act_quant"]})


def add_rms_norm_quant(ctx, x, d, w, eps, act_quant):
    from .quant import act_codes, scheme_of
    s, h = add_rms_norm(ctx, x, d, w, eps)
    return (s, h) + act_codes(h, scheme_of({"quant": act_quant}))


op(name="add_rms_norm_quant", tensors=["x", "delta", "weight"], attrs={"eps": REQUIRED, "act_quant": REQUIRED},
   infer=add_rms_norm_quant_infer, reference=add_rms_norm_quant, n_outputs=4, inplace={0: 0},
   internal=True, templates={"triton": "add_rms_norm"},
   doc="residual add + RMSNorm + the normed row's fp8 activation codes")


# qk_norm_rope_cache and attention_cached live in ops/qk_norm_rope_cache.py and ops/attention.py.
