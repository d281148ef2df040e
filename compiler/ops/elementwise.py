"""Elementwise ops: add(a, b), mul(a, b). (Activations: activation.py.)

b is a's shape, or a's trailing static dims, broadcast over the leading ones (a per-head weight
[H] against [T, H]: Qwen3.5's dt_bias and -exp(A_log)). The result is f32 when either operand is
(torch's promotion: bf16 activations against an f32 weight stay f32), else a's dtype.
"""
import numpy as np

from .base import expect, op, tt


def same(types, attrs):
    a, b = types
    if a.shape != b.shape:
        k = len(b.shape)
        expect(0 < k < len(a.shape) and tuple(a.shape[-k:]) == tuple(b.shape)
               and all(isinstance(d, int) for d in b.shape),
               f"operands differ in shape: {a} vs {b} (the second operand may also be the first's "
               f"trailing static dims, broadcast over its leading ones)")
    return [tt(a.shape, "f32" if "f32" in (a.dtype, b.dtype) else a.dtype)]


def one(types, attrs):
    return [types[0]]


op(name="add", tensors=["a", "b"], infer=same, reference=lambda ctx, a, b: a + b,
   templates={"triton": "add"}, doc="a + b")
op(name="mul", tensors=["a", "b"], infer=same, reference=lambda ctx, a, b: a * b,
   templates={"triton": "mul"}, doc="a * b")
