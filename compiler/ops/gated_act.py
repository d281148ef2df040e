"""Gated activations of an expert's gate|up pair: act(gate, up) -> the row the down projection reads.

    silu            silu(g) * u                                         (SwiGLU: the default)
    clamped_swiglu  g' = min(g, limit), u' = clamp(u, -limit, limit),
                    (u' + 1) * g' * sigmoid(alpha * g')                  (GPT-OSS's experts: alpha
                                                                         1.702, limit 7.0)
    clamped_silu    silu(min(g, limit)) * clamp(u, -limit, limit)       (DeepSeek-V4's experts,
                                                                         limit = swiglu_limit;
                                                                         alpha unused)

    any other activation of ops/activation.py, by its name or HF's hidden_act spelling (gelu,
    gelu_pytorch_tanh, relu, relu2, sigmoid, softplus, swish, ...): act(g) * u (a GeGLU or
    ReGLU expert; GraniteMoe and others run their experts with the config's hidden_act)

An expert op names one by its `act` attr, with `alpha` and `limit` for the clamped form; the
kernels' Triton half is codegen_templates/triton/_gated.j2.
"""
import numpy as np

from .activation import ACTIVATIONS, HF_NAMES, sigmoid, silu
from .base import expect

GATED = ("silu", "clamped_swiglu", "clamped_silu")
GATED_EXTRA = {"act": "silu", "alpha": 1.702, "limit": 7.0}


def check(attrs, who):
    act = attrs.get("act", "silu")
    expect(act in GATED or act in HF_NAMES,
           f"{who}: act must be one of {', '.join(GATED)} or an activation "
           f"({', '.join(sorted(HF_NAMES))}), got {act!r}")
    for a in ("alpha", "limit"):
        v = attrs.get(a, GATED_EXTRA[a])
        expect(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0,
               f"{who}: {a} must be a positive number, got {v!r}")


def gated(g, u, act="silu", alpha=1.702, limit=7.0):
    """act(g, u) in float32."""
    g, u = np.asarray(g, np.float32), np.asarray(u, np.float32)
    if act == "silu":
        return silu(g) * u
    if act not in GATED:
        return (ACTIVATIONS[HF_NAMES[act]](g) * u).astype(np.float32)
    g = np.minimum(g, np.float32(limit))
    u = np.clip(u, np.float32(-limit), np.float32(limit))
    if act == "clamped_silu":
        return (silu(g) * u).astype(np.float32)
    return ((u + 1) * g * sigmoid(np.float32(alpha) * g)).astype(np.float32)


def gated_attrs(attrs) -> dict:
    """The act attrs a node carries (none for the default SwiGLU: plans without them unchanged)."""
    return {a: attrs[a] for a in GATED_EXTRA if a in attrs}
