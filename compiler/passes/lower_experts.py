"""moe_experts -> moe_align + moe_gate_up + moe_down: the experts' generic implementation (not a fusion).

The down projection needs every column of the activation, so the experts run as two launches:
gate|up (stacks concatenated at load time) with the activation, then down with the routing
weights' combine. Before them, moe_align groups the step's tokens by expert (per-expert token
lists and counts) for the prefill kernels, which run one grouped GEMM over every expert's tokens;
where the ids come straight from moe_route, fuse_moe folds the alignment into the router launch.
"""
from ..ir import Node, TensorType, Value
from .fuse_weights import forget_unread, fused_name, register_weight


def lower_experts(state):
    replaced = set()
    for g in state.graph.walk():
        for n in [n for n in g.ordered() if n.op == "moe_experts"]:
            x, w, ids, gate, up, down = n.inputs
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
            act = g.fresh("act")
            g.add_value(Value(act, "act", line=n.line))
            g.add_node(Node(g.new_node_id("moe_gate_up"), "moe_gate_up", [x, ids, fused, rows, counts], [act], {},
                            n.line, fused_from=["moe_experts"]), before=n.id)
            g.add_node(Node(g.new_node_id("moe_down"), "moe_down", [act, w, ids, down, rows, counts],
                            list(n.outputs), {}, n.line, fused_from=["moe_experts"]), before=n.id)
            g.order.remove(n.id)
            del g.nodes[n.id]
            for old in (gate, up):
                del g.values[old]
                replaced.add(old)
            state.note("lower_experts", f"{g.name}: {gate} + {up} -> {fused} (experts)")
    forget_unread(state, replaced)
