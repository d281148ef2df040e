"""Elementwise ops: add(a, b), mul(a, b). (Activations: activation.py.)"""
import numpy as np

from .base import expect, op


def same(types, attrs):
    a, b = types
    expect(a.shape == b.shape, f"operands differ in shape: {a} vs {b}")
    return [a]


def one(types, attrs):
    return [types[0]]


op(name="add", tensors=["a", "b"], infer=same, reference=lambda ctx, a, b: a + b,
   templates={"triton": "add"}, doc="a + b")
op(name="mul", tensors=["a", "b"], infer=same, reference=lambda ctx, a, b: a * b,
   templates={"triton": "mul"}, doc="a * b")
