"""Mixture of experts: softmax top-k routing, then a grouped SwiGLU over the chosen experts.

moe_route(logits[T, E], k, normalize) -> (weights f32[T, k], ids i32[T, k]):
    p = softmax(logits); ids = top-k of p (ties: lower expert id first); weights = p[ids],
    renormalized to sum 1 when `normalize`.
moe_experts(x[T, H], weights, ids, gate[E, F, H], up[E, F, H], down[E, H, F]) -> [T, H]:
    y[t] = sum_j weights[t, j] * down[e] @ (silu(gate[e] @ x[t]) * up[e] @ x[t]), e = ids[t, j].
"""
import numpy as np

from .base import REQUIRED, expect, op, tt
from .elementwise import silu


def route_infer(types, attrs):
    (logits,) = types
    k = attrs["k"]
    expect(len(logits.shape) == 2, f"router logits must be [T, E], got {logits}")
    expect(isinstance(k, int) and 0 < k <= logits.shape[1], f"top-k {k} not in 1..{logits.shape[1]}")
    return [tt((logits.shape[0], k), "f32"), tt((logits.shape[0], k), "i32")]


def route(ctx, logits, k, normalize=False):
    logits = logits.astype(np.float32)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ids = np.argsort(-p, axis=-1, kind="stable")[:, :k].astype(np.int32)
    w = np.take_along_axis(p, ids, axis=-1)
    if normalize:
        w = w / w.sum(-1, keepdims=True)
    return w.astype(np.float32), ids


def experts_infer(types, attrs):
    x, w, ids, gate, up, down = types
    expect(len(gate.shape) == 3 and gate.shape == up.shape, f"expert gate/up must be [E, F, H]: {gate}, {up}")
    expect(gate.shape[2] == x.shape[-1], f"expert gate K={gate.shape[2]} != hidden {x.shape[-1]}")
    expect(tuple(down.shape) == (gate.shape[0], x.shape[-1], gate.shape[1]),
           f"expert down must be [E, H, F] = [{gate.shape[0]}, {x.shape[-1]}, {gate.shape[1]}], got {down}")
    expect(w.shape == ids.shape, f"routing weights {w} and ids {ids} differ")
    return [x]


def experts_gu_infer(types, attrs):
    x, w, ids, gate_up, down = types
    e, f2, h = gate_up.shape
    return experts_infer([x, w, ids, tt((e, f2 // 2, h), gate_up.dtype),
                          tt((e, f2 // 2, h), gate_up.dtype), down], attrs)


def experts(ctx, x, w, ids, gate, up, down):
    y = np.zeros_like(x, dtype=np.float32)
    for e in np.unique(ids):
        rows, slot = np.nonzero(ids == e)
        xe = x[rows]
        h = silu(xe @ gate[e].T) * (xe @ up[e].T)
        y[rows] += (h @ down[e].T) * w[rows, slot][:, None]
    return y


def experts_gu(ctx, x, w, ids, gate_up, down):
    f = gate_up.shape[1] // 2
    return experts(ctx, x, w, ids, gate_up[:, :f], gate_up[:, f:], down)


op(name="moe_route", tensors=["logits"], attrs={"k": REQUIRED, "normalize": False},
   infer=route_infer, reference=route, n_outputs=2, templates={"triton": "moe_route"},
   doc="softmax top-k router")
op(name="moe_experts", tensors=["x", "weights", "ids", "gate", "up", "down"],
   infer=experts_infer, reference=experts, templates={"triton": "moe_experts"},
   doc="grouped SwiGLU experts, weighted sum over the top-k")
op(name="moe_experts_gu", tensors=["x", "weights", "ids", "gate_up", "down"],
   infer=experts_gu_infer, reference=experts_gu, internal=True,
   templates={"triton": {"prefill": "moe_grouped_gemm", "mixed": "moe_grouped_gemm",
                         "decode": "moe_grouped_gemv"}},
   doc="moe_experts with gate and up stacked in one weight [E, 2F, H]")
