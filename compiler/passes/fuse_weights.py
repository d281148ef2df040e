"""Weight fusion: linears that read the same input become one linear over concatenated
weights (q/k/v, gate/up), followed by a `split` view. Biases concatenate the same way (a linear
without one contributes zeros when the others have one). A gated pair (act(gate) * up) fuses
on its own, [gate | up] and nothing else, so fuse_act_mul finds it whole: DeepSeek's router,
shared gate and shared up read one input, and fused as one they left the gated activation four
launches over a strided slice.

The concatenation is a load-time transform recorded in the weights table, so the checkpoint
is read as published and the plan says how each fused weight is built. A weight that several
layer kinds share fuses the same way in each of their bodies.

Quantized linears (compiler/passes/quantize_weights.py) fuse when their schemes are equal and
every part's rows are whole scale blocks: codes, scales and zero points concatenate along the rows
like the weight. Parts with per-column group indices (act-order) or static activation scales keep
their own launches (their activations or columns are not shared).
"""
import json

from ..ir import Node, TensorType, Value
from ..quant.scheme import QuantScheme


def fused_name(wnames: list[str]) -> str:
    """wq, wk, wv -> wqkv; we_gate, we_up -> we_gate_up; other names joined with '_'."""
    stems = [w[1:] if w.startswith("w") and len(w) == 2 else None for w in wnames]
    if all(stems):
        return "w" + "".join(stems)
    prefix = wnames[0].rsplit("_", 1)[0] if "_" in wnames[0] else ""
    if prefix and all(w.startswith(prefix + "_") for w in wnames):
        return prefix + "_" + "_".join(w[len(prefix) + 1:] for w in wnames)
    return "_".join(wnames)


def register_weight(state, g, fused: str, t: TensorType, source: dict, layers, line=None):
    """Declare a weight a pass builds at load time (a concatenation) in g and the weights table."""
    g.add_value(Value(fused, "weight", t, line=line))
    state.weights[fused] = {"source": source, "layers": layers, "type": t, "line": line}


def forget_unread(state, replaced: set):
    """Drop replaced weights from the table unless some graph (another kind's body) still reads them."""
    used = {v.name for g in state.graph.walk() for v in g.values.values() if v.kind == "weight"}
    for w in replaced - used:
        del state.weights[w]


def _gated_pair(g, nodes: list) -> list | None:
    """[gate, up] of `nodes` when some two of them feed only mul(ACT(gate), up), else None."""
    from .fuse_ops import _activation
    out = {n.outputs[0]: n for n in nodes}
    for mul in g.ordered():
        if mul.op != "mul" or len(mul.inputs) != 2:
            continue
        for a, b in (mul.inputs, mul.inputs[::-1]):
            act = g.producer(a)
            if _activation(act) is None or act.inputs[0] not in out or b not in out:
                continue
            if g.uses(act.inputs[0]) == 1 and g.uses(b) == 1 and g.uses(a) == 1:
                return [out[act.inputs[0]], out[b]]
    return None


def _fuse_linears(state, g, dropped: set):
    groups: dict[tuple, list] = {}
    for n in g.ordered():
        if n.op != "linear":
            continue
        w = g.values[n.inputs[1]]
        if w.kind != "weight" or g.uses(w.name) != 1:
            continue
        if n.attrs.get("has_bias") and (g.values[n.inputs[2]].kind != "weight" or g.uses(n.inputs[2]) != 1):
            continue
        meta = state.weights[w.name]
        # linears fuse only where their outputs share a dtype (a row-parallel linear writes fp32)
        key = (n.inputs[0], w.type.shape[1], w.type.dtype, tuple(meta["layers"] or ()),
               n.attrs.get("out_dtype"), json.dumps(n.attrs.get("quant"), sort_keys=True))
        groups.setdefault(key, []).append(n)
    for (x, k, dtype, _, _, _), members in groups.items():
        if not _quant_fusable(g, members):
            continue
        pair = _gated_pair(g, members) if len(members) > 2 else None
        split_off = [pair, [n for n in members if n not in pair]] if pair else [members]
        for nodes in split_off:
            if len(nodes) >= 2:
                _fuse_group(state, g, x, k, dtype, nodes, dropped)


def _quant_fusable(g, nodes: list) -> bool:
    q = nodes[0].attrs.get("quant")
    if q is None:
        return True
    s = QuantScheme.from_attrs(q)
    return not s.g_idx and s.act != "static" and \
        all(g.values[n.inputs[1]].type.shape[0] % s.block_n == 0 for n in nodes)


def _fuse_companions(state, g, nodes: list, fused: str, layers) -> tuple[list, list, dict]:
    """The fused linear's quantization inputs: each companion's parts concatenated on the rows
    (scale blocks are whole, _quant_fusable); returns (inputs, replaced names, attrs)."""
    q = nodes[0].attrs.get("quant")
    if q is None:
        return [], [], {}
    s = QuantScheme.from_attrs(q)
    base = [3 if n.attrs.get("has_bias") else 2 for n in nodes]
    inputs, replaced, attrs = [], [], {"quant": q}
    for j, c in enumerate(s.companions()):
        parts = [n.inputs[b + j] for n, b in zip(nodes, base)]
        t0 = g.values[parts[0]].type
        name = f"{fused}_{c}"
        register_weight(state, g, name, TensorType((sum(g.values[p].type.shape[0] for p in parts),)
                                                   + t0.shape[1:], t0.dtype),
                        {"concat": [state.weights[p]["source"] for p in parts], "axis": 0}, layers)
        inputs.append(name)
        replaced += parts
        attrs["has_" + c] = True
    return inputs, replaced, attrs


def _fuse_group(state, g, x, k, dtype, nodes: list, dropped: set):
    wnames = [n.inputs[1] for n in nodes]
    sizes = [g.values[w].type.shape[0] for w in wnames]
    fused = fused_name(wnames)
    layers = state.weights[wnames[0]]["layers"]
    register_weight(state, g, fused, TensorType((sum(sizes), k), dtype),
              {"concat": [state.weights[w]["source"] for w in wnames], "axis": 0}, layers)
    inputs = [x, fused]
    has_bias = any(n.attrs.get("has_bias") for n in nodes)
    if has_bias:
        bnames = [n.inputs[2] if n.attrs.get("has_bias") else None for n in nodes]
        bsrc = [state.weights[b]["source"] if b else {"zeros": [s]} for b, s in zip(bnames, sizes)]
        bdtype = next(g.values[b].type.dtype for b in bnames if b)
        bfused = fused_name([b for b in bnames if b]) + "_fused" if None in bnames else \
            fused_name(bnames)
        register_weight(state, g, bfused, TensorType((sum(sizes),), bdtype), {"concat": bsrc, "axis": 0}, layers)
        inputs.append(bfused)
        wnames += [b for b in bnames if b]
    q_inputs, q_parts, q_attrs = _fuse_companions(state, g, nodes, fused, layers)
    inputs += q_inputs
    wnames += q_parts
    first = nodes[0]
    y = g.fresh(fused[1:] if fused.startswith("w") else fused)
    g.add_value(Value(y, "act", line=first.line))
    attrs = {"has_bias": has_bias, **q_attrs}
    if first.attrs.get("out_dtype"):
        attrs["out_dtype"] = first.attrs["out_dtype"]
    g.add_node(Node(g.new_node_id("linear"), "linear", inputs, [y], attrs,
                    first.line, fused_from=["linear"] * len(nodes)), before=first.id)
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
        dropped.add(w)
    state.note("fuse_weights", f"{g.name}: {' + '.join(wnames)} -> {fused} {sizes}")


def fuse_weights(state):
    dropped: set = set()
    for g in state.graph.walk():
        _fuse_linears(state, g, dropped)
    forget_unread(state, dropped)
