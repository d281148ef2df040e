"""Mixture of experts: softmax top-k routing, then a grouped SwiGLU over the chosen experts.

moe_route(logits[T, E], k, normalize) -> (weights f32[T, k], ids i32[T, k]):
    p = softmax(logits); ids = top-k of p (ties: lower expert id first); weights = p[ids],
    renormalized to sum 1 when `normalize`.
moe_experts(x[T, H], weights, ids, gate[E, F, H], up[E, F, H], down[E, H, F]) -> [T, H]:
    y[t] = sum_j weights[t, j] * down[e] @ (silu(gate[e] @ x[t]) * up[e] @ x[t]), e = ids[t, j].
"""
import numpy as np

from .base import REQUIRED, expect, op, tt
from .activation import silu


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


def experts(ctx, x, w, ids, gate, up, down):
    y = np.zeros_like(x, dtype=np.float32)
    for e in np.unique(ids):
        rows, slot = np.nonzero(ids == e)
        xe = x[rows]
        h = silu(xe @ gate[e].T) * (xe @ up[e].T)
        y[rows] += (h @ down[e].T) * w[rows, slot][:, None]
    return y


# The experts split in two launches, because the down projection needs every column of the
# activation: moe_gate_up(x, ids, gate_up[E, 2F, H]) -> act[T, k, F] = silu(g) * u per chosen
# expert, then moe_down(act, weights, ids, down[E, H, F]) -> y[t] = sum_j w[t, j] down[e] act[t, j].
def gate_up_infer(types, attrs):
    x, ids, gu = types
    expect(len(gu.shape) == 3 and gu.shape[2] == x.shape[-1] and gu.shape[1] % 2 == 0,
           f"expert gate_up must be [E, 2F, H]: {gu}")
    return [tt((x.shape[0], ids.shape[1], gu.shape[1] // 2), x.dtype)]


def gate_up(ctx, x, ids, gu):
    f = gu.shape[1] // 2
    out = np.zeros((x.shape[0], ids.shape[1], f), np.float32)
    for e in np.unique(ids):
        rows, slot = np.nonzero(ids == e)
        h = x[rows] @ gu[e].T
        out[rows, slot] = silu(h[:, :f]) * h[:, f:]
    return out


def down_infer(types, attrs):
    act, w, ids, down = types
    expect(len(down.shape) == 3 and down.shape[2] == act.shape[2], f"expert down must be [E, H, F]: {down}")
    return [tt((act.shape[0], down.shape[1]), act.dtype)]


def down(ctx, act, w, ids, down_w):
    y = np.zeros((act.shape[0], down_w.shape[1]), np.float32)
    for e in np.unique(ids):
        rows, slot = np.nonzero(ids == e)
        # add.at: a token may name an expert twice (ep_dispatch gives the slots of other ranks'
        # experts local id 0 and weight 0), and y[rows] += would keep only one of them
        np.add.at(y, rows, (act[rows, slot] @ down_w[e].T) * w[rows, slot][:, None])
    return y


op(name="moe_route", tensors=["logits"], attrs={"k": REQUIRED, "normalize": False},
   infer=route_infer, reference=route, n_outputs=2, templates={"triton": "moe_route"},
   doc="softmax top-k router")
op(name="moe_experts", tensors=["x", "weights", "ids", "gate", "up", "down"],
   infer=experts_infer, reference=experts,   # no kernel of its own: lower_experts splits it
   doc="grouped SwiGLU experts, weighted sum over the top-k")
op(name="moe_gate_up", tensors=["x", "ids", "gate_up"], infer=gate_up_infer, reference=gate_up,
   internal=True, templates={"triton": {"prefill": "moe_gate_up", "mixed": "moe_gate_up",
                                        "decode": "moe_gate_up"}},
   doc="per chosen expert: silu(x gate^T) * (x up^T)")
op(name="moe_down", tensors=["act", "weights", "ids", "down"], infer=down_infer, reference=down,
   internal=True, templates={"triton": {"prefill": "moe_down", "mixed": "moe_down", "decode": "moe_down"}},
   doc="per token: routing-weighted sum of the chosen experts' down projections")
