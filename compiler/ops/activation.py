"""Activations: one table from the HF `hidden_act` spelling to the op, its numpy reference and
(in codegen_templates/triton/_activation.j2) its Triton expression.

    silu(x)      = x * sigmoid(x)
    gelu(x)      = x/2 * (1 + erf(x / sqrt 2))
    gelu_tanh(x) = x/2 * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3)))
    relu(x)      = max(x, 0)
    relu2(x)     = max(x, 0)^2
    sigmoid(x)   = 1 / (1 + exp(-x))                       (gates: Qwen3.5's attention output gate, beta)
    softplus(x)  = log(1 + exp(x)), x above 20             (torch's softplus, threshold 20)
"""
import math

import numpy as np

from .base import REQUIRED, expect, op

_SQRT_PI = math.sqrt(math.pi)


def erf(x):
    """erf in float64, vectorised (numpy has none, and scipy is not a dependency): below 2.5 a
    series of positive terms, erf(a) = 2/sqrt(pi) e^(-a^2) sum_n (2a^2)^n a / (1*3*...*(2n+1)),
    so nothing cancels; above, erfc(a) = e^(-a^2)/sqrt(pi) / (a + 1/2/(a + 1/(a + 3/2/(a + ...)))),
    a continued fraction evaluated bottom up. |error| < 2e-15 everywhere (tests check math.erf)."""
    x = np.asarray(x, np.float64)
    a = np.abs(x)
    out = np.empty_like(a)
    lo = a < 2.5
    s = a[lo]
    z, term = 2.0 * s * s, s.copy()
    acc = s.copy()
    for n in range(1, 60):             # the ratio z/(2n+1) < 12.5/(2n+1): 60 terms reach 1e-17
        term = term * z / (2 * n + 1)
        acc += term
    out[lo] = 2.0 / _SQRT_PI * np.exp(-s * s) * acc
    s = a[~lo]
    f = np.zeros_like(s)
    for k in range(60, 0, -1):
        f = (k / 2.0) / (s + f)
    out[~lo] = 1.0 - np.exp(-s * s) / _SQRT_PI / (s + f)
    return np.copysign(out, x)


def silu(x):
    return x / (1.0 + np.exp(-x))


def gelu(x):
    x64 = np.asarray(x, np.float64)
    return (0.5 * x64 * (1.0 + erf(x64 * math.sqrt(0.5)))).astype(np.float32)


def gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


def relu(x):
    return np.maximum(x, 0.0)


def relu2(x):
    return np.square(np.maximum(x, 0.0))


def sigmoid(x):
    with np.errstate(over="ignore"):            # exp(-x) = inf far below 0: sigmoid 0, as torch
        return 1.0 / (1.0 + np.exp(-x))


def softplus(x):
    x = np.asarray(x)
    return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0)))).astype(x.dtype)


ACTIVATIONS = {"silu": silu, "gelu": gelu, "gelu_tanh": gelu_tanh, "relu": relu, "relu2": relu2,
               "sigmoid": sigmoid, "softplus": softplus}
# HF `hidden_act` / `hidden_activation` spellings -> our name
HF_NAMES = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
            "gelu_new": "gelu_tanh", "gelu_tanh": "gelu_tanh", "relu": "relu", "relu2": "relu2",
            "sigmoid": "sigmoid", "softplus": "softplus"}


def resolve(fn) -> str:
    """An HF activation name -> ours; ValueError names the known ones."""
    if fn not in HF_NAMES:
        raise ValueError(f"unknown activation '{fn}' (known: {', '.join(sorted(HF_NAMES))})")
    return HF_NAMES[fn]


def _one(types, attrs):
    return [types[0]]


for _name, _fn in ACTIVATIONS.items():
    op(name=_name, tensors=["x"], infer=_one, reference=lambda ctx, x, _f=_fn: _f(x),
       templates={"triton": "act"}, strided=True, doc=f"{_name} activation, elementwise")


def clamp(x, min=None, max=None):
    """torch.clamp: x limited to [min, max], either bound optional (computed in float32)."""
    return np.clip(np.asarray(x, np.float32), min, max)


def _clamp_infer(types, attrs):
    lo, hi = attrs.get("min"), attrs.get("max")
    for name, v in (("min", lo), ("max", hi)):
        expect(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)),
               f"clamp {name} must be a number or none, got {v!r}")
    expect(lo is not None or hi is not None, "clamp needs min, max or both")
    expect(lo is None or hi is None or lo <= hi, f"clamp min {lo} is above max {hi}")
    return [types[0]]


# clamp(x, min, max): GPT-OSS's limits, Gemma's soft caps' hard cousins, any family's bounds
op(name="clamp", tensors=["x"], attrs={"min": None, "max": None}, infer=_clamp_infer,
   reference=lambda ctx, x, min=None, max=None: clamp(x, min, max), templates={"triton": "act"}, strided=True,
   doc="torch.clamp(x, min, max), elementwise")


def _threshold(ctx, x, threshold, value):
    """torch's F.threshold: x where x > threshold, else value (computed in float32)."""
    x = np.asarray(x, np.float32)
    return np.where(x > np.float32(threshold), x, np.float32(value))


def _threshold_infer(types, attrs):
    for name in ("threshold", "value"):
        v = attrs.get(name)
        expect(isinstance(v, (int, float)) and not isinstance(v, bool),
               f"threshold {name} must be a number, got {v!r}")
    return [types[0]]


# threshold(x, threshold, value): F.threshold; with a router's weights, the experts scoring at most
# `threshold` weigh `value` (0: a threshold-masked router from moe_route's all-expert scores)
op(name="threshold", tensors=["x"], attrs={"threshold": REQUIRED, "value": REQUIRED}, infer=_threshold_infer,
   reference=_threshold,
   templates={"triton": "act"}, strided=True, doc="F.threshold(x, threshold, value), elementwise")


def _act_infer(types, attrs):
    try:
        resolve(attrs["fn"])
    except ValueError as e:
        expect(False, f"act: {e}")
    return [types[0]]


# act(x, fn): the activation a config names (fn = hidden_act); lowered to the named op.
op(name="act", tensors=["x"], attrs={"fn": REQUIRED}, infer=_act_infer,
   reference=lambda ctx, x, fn: ACTIVATIONS[resolve(fn)](x), templates={"triton": "act"}, strided=True,
   doc="the activation named by fn (an HF hidden_act string)")


# -- xIELU (Apertus) ----------------------------------------------------------------------------
# xielu(x, alpha_p, alpha_n, beta=0.5, eps=-1e-6), transformers' XIELUActivation:
#     ap = softplus(alpha_p),  an = beta + softplus(alpha_n)
#     y  = ap x^2 + beta x                        x > 0
#          an (expm1(min(x, eps)) - x) + beta x    x <= 0
# alpha_p / alpha_n are the module's trained parameters (one value each, [1], a checkpoint tensor
# per layer: `mlp.act_fn.alpha_p`), read as stored and passed through softplus as HF does; beta
# and eps are constants (config expressions; HF's defaults, which Apertus's MLP never overrides).

def xielu(x, alpha_p, alpha_n, beta=0.5, eps=-1e-6):
    x = np.asarray(x, np.float32)
    beta, eps = np.float32(beta), np.float32(eps)
    ap = softplus(np.asarray(alpha_p, np.float32).reshape(()))
    an = beta + softplus(np.asarray(alpha_n, np.float32).reshape(()))
    return np.where(x > 0, ap * x * x + beta * x, (np.expm1(np.minimum(x, eps)) - x) * an + beta * x)


def _xielu_infer(types, attrs):
    x, ap, an = types
    for name, t in (("alpha_p", ap), ("alpha_n", an)):
        expect(tuple(t.shape) == (1,), f"xielu {name} must be one value, shape [1], got {t}")
    for name in ("beta", "eps"):
        v = attrs.get(name)
        expect(isinstance(v, (int, float)) and not isinstance(v, bool),
               f"xielu {name} must be a number, got {v!r}")
    return [x]


op(name="xielu", tensors=["x", "alpha_p", "alpha_n"], attrs={"beta": 0.5, "eps": -1e-6},
   infer=_xielu_infer, reference=lambda ctx, x, ap, an, beta=0.5, eps=-1e-6: xielu(x, ap, an, beta, eps),
   templates={"triton": "act"}, doc="xIELU (Apertus): trained alpha_p / alpha_n [1], constant beta, eps")
