"""moe_experts -> moe_align + moe_gate_up + moe_down: the experts' generic implementation (not a fusion).

The down projection needs every column of the activation, so the experts run as two launches:
gate|up (stacks concatenated at load time) with the activation, then down with the routing
weights' combine. Before them, moe_align groups the step's tokens by expert (per-expert token
lists and counts) for the prefill kernels, which run one grouped GEMM over every expert's tokens;
where the ids come straight from moe_route, fuse_moe folds the alignment into the router launch.
Expert biases concatenate as their weights do (gate|up's [E, 2F], a missing half zeros) and ride
each launch as its bias; the gated activation's attrs (act, alpha, limit) go to moe_gate_up.
"""
from ..ir import Node, TensorType, Value
from ..ops.gated_act import gated_attrs
from ..ops.moe import bias_inputs
from .fuse_weights import forget_unread, fused_name, register_weight


def _gate_up_bias(state, g, n, biases, gt):
    """The fused [E, 2F] gate|up bias (zeros for a missing half), or None without biases."""
    gb, ub = biases.get("gate_bias"), biases.get("up_bias")
    if gb is None and ub is None:
        return None
    E, F = gt.shape[0], gt.shape[1]
    fused = fused_name([b for b in (gb, ub) if b is not None]) + ("" if gb and ub else "_gu")
    if fused not in g.values:
        parts = [state.weights[b]["source"] if b else {"zeros": [E, F]} for b in (gb, ub)]
        layers = state.weights[gb or ub]["layers"]
        register_weight(state, g, fused, TensorType((E, 2 * F), g.values[gb or ub].type.dtype),
                        {"concat": parts, "axis": 1}, layers)
    return fused


def lower_experts(state):
    replaced = set()
    for g in state.graph.walk():
        for n in [n for n in g.ordered() if n.op == "moe_experts"]:
            x, w, ids, gate, up, down = n.inputs[:6]
            biases = bias_inputs(n.inputs, n.attrs)
            gt = g.values[gate].type
            fused = fused_name([gate, up])
            if fused not in g.values:
                register_weight(state, g, fused,
                                TensorType((gt.shape[0], 2 * gt.shape[1], gt.shape[2]), gt.dtype),
                                {"concat": [state.weights[gate]["source"], state.weights[up]["source"]],
                                 "axis": 1},
                                state.weights[gate]["layers"])
            rows, counts = g.fresh("expert_rows"), g.fresh("expert_counts")
            for v in (rows, counts):
                g.add_value(Value(v, "act", line=n.line))
            g.add_node(Node(g.new_node_id("moe_align"), "moe_align", [ids], [rows, counts],
                            {"experts": gt.shape[0]}, n.line, fused_from=["moe_experts"]), before=n.id)
            unweighted = n.attrs.get("weigh", "output") == "input"
            if unweighted:               # one expert a token (ops/moe.py): scale its row, once
                scaled = g.fresh("expert_in")
                g.add_value(Value(scaled, "act", line=n.line))
                g.add_node(Node(g.new_node_id("mul"), "mul", [x, w], [scaled],
                                {"dtype": g.values[x].type.dtype}, n.line, fused_from=["moe_experts"]),
                           before=n.id)
                x = scaled
            act = g.fresh("act")
            g.add_value(Value(act, "act", line=n.line))
            gu_bias = _gate_up_bias(state, g, n, biases, gt)
            db = biases.get("down_bias")
            g.add_node(Node(g.new_node_id("moe_gate_up"), "moe_gate_up",
                            [x, ids, fused, rows, counts] + ([gu_bias] if gu_bias else []), [act],
                            {**({"has_bias": True} if gu_bias else {}), **gated_attrs(n.attrs)},
                            n.line, fused_from=["moe_experts"]), before=n.id)
            g.add_node(Node(g.new_node_id("moe_down"), "moe_down",
                            [act, w, ids, down, rows, counts] + ([db] if db else []),
                            list(n.outputs), {**({"has_bias": True} if db else {}),
                                              **({"unweighted": True} if unweighted else {})}, n.line,
                            fused_from=["moe_experts"]), before=n.id)
            g.order.remove(n.id)
            del g.nodes[n.id]
            if gu_bias:
                for b in ("gate_bias", "up_bias"):
                    if b in biases and biases[b] in g.values:
                        del g.values[biases[b]]
                        replaced.add(biases[b])
            for old in (gate, up):
                del g.values[old]
                replaced.add(old)
            state.note("lower_experts", f"{g.name}: {gate} + {up} -> {fused} (experts)")
    forget_unread(state, replaced)
