"""Gated MLP activations on a fused [gate | up] buffer (ops that only fusion passes create).

    act_mul(gu[..., 2F], fn)            = act(gu[..., :F]) * gu[..., F:]     (SwiGLU when fn = silu,
                                                                             GeGLU when fn = gelu*)
    linear_act_mul(gu, w[N, F], [b], fn) = act_mul(gu, fn) @ w.T (+ b)
    linear_gated(x, w[2F, K], [b], fn)   = act_mul(x @ w.T (+ b), fn)       (gate|up, act in the epilogue)

`fn` is one of activation.ACTIVATIONS (the passes store our name, not HF's spelling). Each
reference is the composition of the spec ops it replaces, so the fusion is correct exactly when
the reference executor's logits do not move.
"""
from .activation import ACTIVATIONS, resolve
from .base import REQUIRED, expect, op, tt
from .linear import out_dtype
from .quant import CODES_OPTIONAL, QUANT_OPTIONAL, check_types, operands


def _fn(attrs, who):
    try:
        return resolve(attrs["fn"])
    except ValueError as e:
        expect(False, f"{who}: {e}")


def _bias(types, attrs, n: int, who: str):
    """An optional bias (attrs has_bias, the input after the weight) must be [n]."""
    if attrs.get("has_bias"):
        expect(len(types) >= 3 and types[2].shape == (n,), f"{who} bias must be [{n}], got {types[2:3]}")
    check_types(types, attrs, 3 if attrs.get("has_bias") else 2, who)


def act_mul_infer(types, attrs):
    (gu,) = types
    _fn(attrs, "act_mul")
    expect(gu.shape[-1] % 2 == 0, f"act_mul needs an even last dim, got {gu}")
    return [tt(gu.shape[:-1] + (gu.shape[-1] // 2,), gu.dtype)]


def act_mul(ctx, gu, fn):
    f = gu.shape[-1] // 2
    return ACTIVATIONS[resolve(fn)](gu[..., :f]) * gu[..., f:]


op(name="act_mul", tensors=["gate_up"], attrs={"fn": REQUIRED}, infer=act_mul_infer,
   reference=act_mul, internal=True, templates={"triton": "act_mul"},
   doc="gated activation act(gate) * up on a [gate | up] buffer")


def linear_act_mul_infer(types, attrs):
    gu, w = types[:2]
    _fn(attrs, "linear_act_mul")
    expect(gu.shape[-1] == 2 * w.shape[1], f"gate_up width {gu.shape[-1]} != 2 x weight K {w.shape[1]}")
    _bias(types, attrs, w.shape[0], "linear_act_mul")
    return [tt(gu.shape[:-1] + (w.shape[0],), out_dtype(gu, attrs))]


def linear_act_mul(ctx, gu, w, *rest, fn, out_dtype=None, **attrs):
    a, w, bias = operands(act_mul(ctx, gu, fn), w, rest, attrs)
    y = a @ w.T
    return y if bias is None else y + bias


# The activation runs in the GEMM/GEMV's A-operand load: the [rows, F] intermediate is never
# written. A bias (mlp_bias models) is added in the epilogue like linear's.
op(name="linear_act_mul", tensors=["gate_up", "weight"], optional=["bias"], pass_inputs=QUANT_OPTIONAL,
   attrs={"fn": REQUIRED, "has_bias": False}, infer=linear_act_mul_infer,
   reference=linear_act_mul, internal=True,
   templates={"triton": {"prefill": "gemm_act_mul", "mixed": "gemm_act_mul",
                         "decode": "gemv_act_mul", "short": "gemv_act_mul"}},
   doc="down projection with the gated activation fused into its input load")


def linear_gated_infer(types, attrs):
    x, w = types[:2]
    _fn(attrs, "linear_gated")
    expect(len(w.shape) == 2 and w.shape[0] % 2 == 0,
           f"linear_gated weight must be [2F, K] (gate rows, then up rows), got {w}")
    expect(x.shape[-1] == w.shape[1], f"linear_gated: input {x} has K={x.shape[-1]} but weight {w} "
                                      f"has K={w.shape[1]}")
    _bias(types, attrs, w.shape[0], "linear_gated")
    # ready activation codes (attrs.has_a_scale) stand for the bf16 activations they were made from
    return [tt(x.shape[:-1] + (w.shape[0] // 2,), "bf16" if x.dtype == "f8e4m3" else x.dtype)]


def linear_gated(ctx, x, w, *rest, fn, **attrs):
    x, w, bias = operands(x, w, rest, attrs)
    gu = x @ w.T
    return act_mul(ctx, gu if bias is None else gu + bias, fn)


# The gate|up projection with the gated activation in its epilogue: each output tile's program
# streams the matching gate rows f and up rows F + f, so only the [rows, F] activation is written,
# and the down projection after it is a plain linear (a GEMM that reads a ready A tile runs
# 1.4-1.5x faster than one that builds it in registers, bench/NOTES.md). The epilogue rounds as
# HF's MLP does: g and u to bf16 (the projection's outputs), act(g) to bf16, then act(g) * u.
op(name="linear_gated", tensors=["x", "weight"], optional=["bias"], pass_inputs=CODES_OPTIONAL,
   attrs={"fn": REQUIRED, "has_bias": False}, infer=linear_gated_infer,
   reference=linear_gated, internal=True,
   templates={"triton": {"prefill": "gemm_gated", "mixed": "gemm_gated",
                         "decode": "gemv_gated", "short": "gemv_gated"}},
   doc="gate|up projection with the gated activation act(gate) * up fused into its epilogue")
