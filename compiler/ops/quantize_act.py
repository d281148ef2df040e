"""quantize_act(x[..., K], [x_scale]) -> (codes f8e4m3 [..., K], a_scale f32 [..., G]): the
activation quantizer of an fp8 linear (compiler/ops/quant.py's definition), made once a step
for every launch that reads x, instead of inside every program of the linear's launch.

    dynamic_group  G = ceil(K / act_group): s[g] = amax(|x[g's columns]|) / 448 (1 where 0)
    dynamic_token  G = 1, the same over the whole row
    static         G = 1, s = x_scale[0] (the checkpoint's per-tensor scale, repeated a row)
    codes = e4m3(x / s), round-to-nearest-even, saturating at +-448; x / s an IEEE division

so codes * s is quantize_activations(x) bit for bit. attrs.act_quant: the scheme of the linear
that reads them (its act fields say how; attrs.quant would mark a launch reading quantized weights). Internal: compiler/passes/
act_codes.py inserts it before the linears that read the codes (attrs.has_a_scale).
"""
from .base import REQUIRED, expect, op, tt
from .quant import act_codes, act_groups, reads_codes, scheme_of


def infer(types, attrs):
    x = types[0]
    s = scheme_of({"quant": attrs.get("act_quant")})
    expect(reads_codes(s), f"quantize_act: needs an fp8 scheme with quantized activations, got {s}")
    expect(x.dtype in ("bf16", "f16", "f32"), f"quantize_act: x must be a float tensor, got {x}")
    expect((s.act == "static") == bool(attrs.get("has_x_scale")),
           "quantize_act: x_scale is given exactly for static activations")
    if s.act == "static":
        expect(types[1].dtype == "f32" and tuple(types[1].shape) == (1,),
               f"quantize_act: x_scale must be f32 [1], got {types[1]}")
    k = x.shape[-1]
    return [tt(x.shape, "f8e4m3"), tt(x.shape[:-1] + (act_groups(s, k),), "f32")]


def reference(ctx, x, *rest, act_quant, **attrs):
    return act_codes(x, scheme_of({"quant": act_quant}), rest[0] if rest else None)


op(name="quantize_act", tensors=["x"], pass_inputs=["x_scale"], attrs={"act_quant": REQUIRED},
   infer=infer, reference=reference, n_outputs=2, internal=True,
   templates={"triton": "quantize_act"},
   doc="e4m3 codes + per-row group scales of a linear's activations, made once")
