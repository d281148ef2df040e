"""Elementwise ops: add(a, b), mul(a, b). (Activations: activation.py.)

b is a's shape, or a's trailing static dims, broadcast over the leading ones (a per-head weight
[H] against [T, H]: Qwen3.5's dt_bias and -exp(A_log)), or a's shape with size-1 trailing axes,
broadcast over them (a per-token scalar [T, 1] against [T, H]: a shared expert's sigmoid gate,
Qwen2-MoE's and Qwen3-Next's). The result is f32 when either operand is (torch's promotion: bf16
activations against an f32 weight stay f32), else a's dtype.
"""
import numpy as np

from .base import expect, op, tt


def row_broadcast(a_shape, b_shape) -> int | None:
    """m where b is a's shape with axes m.. of size 1 and a's axes m.. static (b broadcast over
    them), else None."""
    if len(a_shape) != len(b_shape) or tuple(a_shape) == tuple(b_shape):
        return None
    m = len(b_shape)
    while m > 0 and b_shape[m - 1] == 1:
        m -= 1
    if m == 0 or tuple(a_shape[:m]) != tuple(b_shape[:m]) or not all(isinstance(d, int) for d in a_shape[m:]):
        return None
    return m


def same(types, attrs):
    a, b = types
    if a.shape != b.shape and row_broadcast(a.shape, b.shape) is None:
        k = len(b.shape)
        expect(0 < k < len(a.shape) and tuple(a.shape[-k:]) == tuple(b.shape)
               and all(isinstance(d, int) for d in b.shape),
               f"operands differ in shape: {a} vs {b} (the second operand may also be the first's "
               f"trailing static dims, broadcast over its leading ones, or its shape with size-1 "
               f"trailing axes, broadcast over them)")
    dtype = attrs.get("dtype")
    expect(dtype in (None, "bf16", "f16", "f32"), f"add/mul dtype must be bf16, f16 or f32, got {dtype!r}")
    return [tt(a.shape, dtype or ("f32" if "f32" in (a.dtype, b.dtype) else a.dtype))]


def one(types, attrs):
    return [types[0]]


# dtype (extra: absent from the plans of specs that don't give it): the result's dtype instead of
# the promoted one, e.g. mul(x, w, dtype=bf16) keeps a bf16 row scaled by an f32 weight bf16
# (Llama-4's experts' input, compiler/passes/lower_experts.py)
op(name="add", tensors=["a", "b"], extra_attrs={"dtype": None}, infer=same,
   reference=lambda ctx, a, b, dtype=None: a + b, templates={"triton": "add"}, doc="a + b")
op(name="mul", tensors=["a", "b"], extra_attrs={"dtype": None}, infer=same,
   reference=lambda ctx, a, b, dtype=None: a * b, templates={"triton": "mul"}, doc="a * b")
