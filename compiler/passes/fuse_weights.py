"""Weight fusion: linears that read the same input become one linear over concatenated
weights (q/k/v, gate/up), followed by a `split` view; MoE experts get their gate/up stacks
concatenated and run as two launches (gate_up + SwiGLU, then down + weighted combine).

The concatenation is a load-time transform recorded in the weights table, so the checkpoint
is read as published and the plan says how each fused weight is built.
"""
from ..ir import Node, TensorType, Value


def fused_name(wnames: list[str]) -> str:
    """wq, wk, wv -> wqkv; we_gate, we_up -> we_gate_up; other names joined with '_'."""
    stems = [w[1:] if w.startswith("w") and len(w) == 2 else None for w in wnames]
    if all(stems):
        return "w" + "".join(stems)
    prefix = wnames[0].rsplit("_", 1)[0] if "_" in wnames[0] else ""
    if prefix and all(w.startswith(prefix + "_") for w in wnames):
        return prefix + "_" + "_".join(w[len(prefix) + 1:] for w in wnames)
    return "_".join(wnames)


def _fuse_linears(state, g):
    groups: dict[tuple, list] = {}
    for n in g.ordered():
        if n.op != "linear":
            continue
        w = g.values[n.inputs[1]]
        if w.kind != "weight" or g.uses(w.name) != 1:
            continue
        key = (n.inputs[0], w.type.shape[1], w.type.dtype)
        groups.setdefault(key, []).append(n)
    for (x, k, dtype), nodes in groups.items():
        if len(nodes) < 2:
            continue
        wnames = [n.inputs[1] for n in nodes]
        sizes = [g.values[w].type.shape[0] for w in wnames]
        fused = fused_name(wnames)
        g.add_value(Value(fused, "weight", TensorType((sum(sizes), k), dtype)))
        state.weights[fused] = {
            "source": {"concat": [state.weights[w]["source"] for w in wnames], "axis": 0},
            "per_layer": state.weights[wnames[0]]["per_layer"]}
        first = nodes[0]
        y = g.fresh(fused[1:] if fused.startswith("w") else fused)
        g.add_value(Value(y, "act", line=first.line))
        g.add_node(Node(g.new_node_id("linear"), "linear", [x, fused], [y], {}, first.line,
                        fused_from=["linear"] * len(nodes)), before=first.id)
        parts = [g.fresh("part") for _ in nodes]
        for p in parts:
            g.add_value(Value(p, "act", line=first.line))
        split = Node(g.new_node_id("split"), "split", [y], parts, {"sizes": sizes}, first.line)
        g.add_node(split, before=first.id)
        for n, p in zip(nodes, parts):
            g.replace_uses(n.outputs[0], p)
            g.remove_node(n.id)
        for w in wnames:
            del g.values[w]
            del state.weights[w]
        state.note("fuse_weights", f"{g.name}: {' + '.join(wnames)} -> {fused} {sizes}")


def _fuse_experts(state, g):
    for n in g.ordered():
        if n.op != "moe_experts":
            continue
        x, w, ids, gate, up, down = n.inputs
        gt = g.values[gate].type
        fused = fused_name([gate, up])
        g.add_value(Value(fused, "weight", TensorType((gt.shape[0], 2 * gt.shape[1], gt.shape[2]), gt.dtype)))
        state.weights[fused] = {
            "source": {"concat": [state.weights[gate]["source"], state.weights[up]["source"]], "axis": 1},
            "per_layer": state.weights[gate]["per_layer"]}
        act = g.fresh("act")
        g.add_value(Value(act, "act", line=n.line))
        g.add_node(Node(g.new_node_id("moe_gate_up"), "moe_gate_up", [x, ids, fused], [act], {},
                        n.line, fused_from=["moe_experts"]), before=n.id)
        g.add_node(Node(g.new_node_id("moe_down"), "moe_down", [act, w, ids, down], list(n.outputs),
                        {}, n.line, fused_from=["moe_experts"]), before=n.id)
        g.order.remove(n.id)
        del g.nodes[n.id]
        for old in (gate, up):
            del g.values[old]
            del state.weights[old]
        state.note("fuse_weights", f"{g.name}: {gate} + {up} -> {fused} (experts)")


def fuse_weights(state):
    for g in state.graph.walk():
        _fuse_linears(state, g)
        _fuse_experts(state, g)
