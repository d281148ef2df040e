"""Elementwise ops with scalar parameters (compile-time constants):

    affine(x, mul=1.0, add=0.0) = x * mul + add      internal: the lowering of mul(x, c) / add(x, c)
                                                     with a scalar c (a config expression)
    softcap(x, cap)             = cap * tanh(x / cap)   Gemma-style logit soft-capping
"""
import numpy as np

from .base import REQUIRED, expect, op


def _one(types, attrs):
    return [types[0]]


def _softcap_infer(types, attrs):
    expect(float(attrs["cap"]) > 0, f"softcap: cap must be > 0, got {attrs['cap']}")
    return [types[0]]


def affine(ctx, x, mul=1.0, add=0.0):
    return x * np.float32(mul) + np.float32(add)


def softcap(ctx, x, cap):
    return np.float32(cap) * np.tanh(x / np.float32(cap))


op(name="affine", tensors=["x"], attrs={"mul": 1.0, "add": 0.0}, infer=_one, reference=affine,
   templates={"triton": "scalar"}, internal=True, doc="x * mul + add, scalar constants")
op(name="softcap", tensors=["x"], attrs={"cap": REQUIRED}, infer=_softcap_infer, reference=softcap,
   templates={"triton": "softcap"}, doc="cap * tanh(x / cap)")
