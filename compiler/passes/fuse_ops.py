"""Op fusion patterns. Each rewrite replaces a chain of spec ops by one fused op whose
numpy reference is the chain's composition (see ops/fused.py).
"""
from ..ir import Graph, Node, Value
from ..ops import REGISTRY
from ..ops.activation import ACTIVATIONS, resolve
from ..ops.rms_norm import has_weight
from ..ops.quant import quant_attrs


def _single_user(g: Graph, value: str):
    users = g.users(value)
    if len(users) == 1 and users[0].inputs.count(value) == 1 and value not in g.outputs:
        return users[0]
    return None


def _only(g: Graph, value: str, op: str):
    """The producer of `value` if it is `op` and `value` has no other user, else None."""
    p = g.producer(value)
    return p if p is not None and p.op == op and _single_user(g, value) is not None else None


def _new(g, hint, line):
    name = g.fresh(hint)
    g.add_value(Value(name, "act", line=line))
    return name


def _later_uses(g: Graph, value: str, after: str) -> bool:
    idx = g.order.index(after)
    return any(value in g.nodes[n].inputs for n in g.order[idx + 1:]) or value in g.outputs


def fuse_add_rms_norm(state):
    """s = add(x, d); h = rms_norm(s, w)  ->  s, h = add_rms_norm(x, d, w), s written over x."""
    for g in state.graph.walk():
        for add in [n for n in g.ordered() if n.op == "add"]:
            s = add.outputs[0]
            norms = [u for u in g.users(s) if u.op == "rms_norm" and u.inputs[0] == s and has_weight(u)]
            if not norms or _later_uses(g, add.inputs[0], add.id):
                continue
            norm = norms[0]
            h = norm.outputs[0]
            s2, h2 = _new(g, "x", add.line), _new(g, "h", norm.line)
            fused = Node(g.new_node_id("add_rms_norm"), "add_rms_norm",
                         [add.inputs[0], add.inputs[1], norm.inputs[1]], [s2, h2],
                         {"eps": norm.attrs["eps"]}, norm.line, fused_from=["add", "rms_norm"])
            g.add_node(fused, before=add.id)
            g.replace_uses(s, s2)
            g.replace_uses(h, h2)
            g.remove_node(norm.id)
            g.remove_node(add.id)
            state.note("fuse_add_rms_norm", f"{g.name}: line {norm.line}")


def _trace(g, value, ops):
    """Walk producers back through `ops` (in order, each optional); returns (value, nodes)."""
    nodes = {}
    for op in ops:
        p = _only(g, value, op)
        if p is not None:
            nodes[op] = p
            value = p.inputs[0]
    return value, nodes


def fuse_qk_norm_rope_cache(state):
    """q/k: split -> view -> [rms_norm] -> rope, v: split -> view, into kv_write + attention_cached:
    becomes qk_norm_rope_cache(qkv) writing the KV cache, then attention_cached. The split's first
    three parts are q, k, v; a part after them (an output gate) stays the split's, read by others."""
    fused_attrs = REGISTRY["qk_norm_rope_cache"].attrs
    for g in state.graph.walk():
        for kvw in [n for n in g.ordered() if n.op == "kv_write"]:
            att = next((u for u in g.users(kvw.outputs[0]) if u.op == "attention_cached"), None)
            if att is None or g.uses(kvw.outputs[0]) != 1:
                continue
            q, k, v = att.inputs[0], kvw.inputs[0], kvw.inputs[1]
            q_src, qn = _trace(g, q, ["rope", "rms_norm", "view"])
            k_src, kn = _trace(g, k, ["rope", "rms_norm", "view"])
            v_src, vn = _trace(g, v, ["view"])
            if "rope" not in qn or "rope" not in kn or "view" not in qn or "view" not in kn \
                    or "view" not in vn or not all(has_weight(n["rms_norm"]) for n in (qn, kn) if "rms_norm" in n):
                continue
            split = g.producer(q_src)
            if split is None or split.op != "split" or split.outputs[:3] != [q_src, k_src, v_src]:
                continue
            rq, rk = qn["rope"], kn["rope"]
            if rq.attrs != rk.attrs or any(a not in fused_attrs and val is not None
                                           for a, val in rq.attrs.items()):
                continue
            norms, eps = [], []
            for nodes in (qn, kn):
                if "rms_norm" in nodes:
                    norms.append(nodes["rms_norm"].inputs[1])
                    eps.append(nodes["rms_norm"].attrs["eps"])
            if len(set(eps)) > 1:
                continue
            qt, kt = g.values[q].type, g.values[k].type
            # the rope's attributes the fused op declares (any other is None here, e.g. rope's
            # interleaved: rotate-half)
            rope_attrs = {a: val for a, val in rq.attrs.items() if a in fused_attrs}
            attrs = {"q_heads": qt.shape[1], "kv_heads": kt.shape[1], "head_dim": qt.shape[2],
                     "eps": eps[0] if eps else 0.0, **rope_attrs, "q_norm": "rms_norm" in qn,
                     "k_norm": "rms_norm" in kn}
            qr, kv = _new(g, "q", att.line), _new(g, "cache", att.line)
            chain = ["rms_norm", "rope"] if norms else ["rope"]
            g.add_node(Node(g.new_node_id("qk_norm_rope_cache"), "qk_norm_rope_cache",
                            [split.inputs[0]] + norms, [qr, kv], attrs, att.line,
                            fused_from=chain * 2 + ["view"] * 3 + ["kv_write"]), before=kvw.id)
            att.inputs = [qr, kv] + att.inputs[2:]       # (and its sinks, if any)
            g.remove_node(kvw.id)
            for nodes in (qn, kn, vn):
                for n in nodes.values():
                    g.remove_node(n.id)
            if all(g.uses(o) == 0 and o not in g.outputs for o in split.outputs):
                g.remove_node(split.id)
            state.note("fuse_qk_norm_rope_cache", f"{g.name}: line {att.line} "
                                                  f"({'with' if norms else 'without'} q/k norm)")


def _activation(node):
    """The activation a node applies (our name, e.g. "gelu_tanh"), or None: an activation op
    (silu, gelu, ...) or act(x, fn) with fn an HF hidden_act spelling."""
    if node is None:
        return None
    if node.op in ACTIVATIONS:
        return node.op
    if node.op == "act":
        return resolve(node.attrs["fn"])
    return None


def fuse_act_mul(state):
    """mul(ACT(g), u) (either operand order) with g, u the first and second halves of one fused
    [gate | up] output -> act_mul(gate_up, fn=ACT): SwiGLU, GeGLU, ReGLU, ..."""
    for g in state.graph.walk():
        for mul in [n for n in g.ordered() if n.op == "mul" and len(n.inputs) == 2]:
            for a, b in (mul.inputs, mul.inputs[::-1]):
                act = g.producer(a)
                fn = _activation(act)
                if fn is None or _single_user(g, a) is None:
                    continue
                split = g.producer(act.inputs[0])
                if split is None or split.op != "split" or split.outputs != [act.inputs[0], b] \
                        or len(set(split.attrs["sizes"])) != 1:
                    continue
                if _single_user(g, act.inputs[0]) is None or _single_user(g, b) is None:
                    continue
                out = _new(g, "act", mul.line)
                g.add_node(Node(g.new_node_id("act_mul"), "act_mul", [split.inputs[0]], [out],
                                {"fn": fn}, mul.line, fused_from=[act.op, "mul"]), before=mul.id)
                g.replace_uses(mul.outputs[0], out)
                for n in (mul, act, split):
                    g.remove_node(n.id)
                state.note("fuse_act_mul", f"{g.name}: line {mul.line} ({fn})")
                break


def fuse_linear_epilogue(state):
    """act_mul(linear(x, w_gate_up[, b])) -> linear_gated(x, w_gate_up[, b]): the gated activation
    moves into the gate|up GEMM's epilogue, so the down projection after it stays a plain linear
    (fuse_linear_prologue then finds no act_mul to take). A linear with fp32 partial sums (a
    row-parallel one) is left alone: its activation must wait for the all-reduce."""
    for g in state.graph.walk():
        for act in [n for n in g.ordered() if n.op == "act_mul"]:
            lin = g.producer(act.inputs[0])
            if lin is None or lin.op != "linear" or lin.attrs.get("out_dtype") \
                    or _single_user(g, act.inputs[0]) is None:
                continue
            out = _new(g, "act", act.line)
            attrs = {"fn": act.attrs["fn"], "has_bias": bool(lin.attrs.get("has_bias")),
                     **quant_attrs(lin.attrs)}
            g.add_node(Node(g.new_node_id("linear_gated"), "linear_gated", list(lin.inputs), [out],
                            attrs, lin.line, fused_from=lin.fused_from + act.fused_from),
                       before=lin.id)
            g.replace_uses(act.outputs[0], out)
            g.remove_node(act.id)
            g.remove_node(lin.id)
            state.note("fuse_linear_epilogue", f"{g.name}: line {lin.line}")


def fuse_linear_prologue(state):
    """linear(act_mul(gu), w[, b]) -> linear_act_mul(gu, w[, b]): the activation moves into the
    GEMM's input load, so the [T, F] intermediate is never written."""
    for g in state.graph.walk():
        for lin in [n for n in g.ordered() if n.op == "linear"]:
            act = g.producer(lin.inputs[0])
            if act is None or act.op != "act_mul" or _single_user(g, lin.inputs[0]) is None:
                continue
            out = _new(g, "y", lin.line)
            attrs = {"fn": act.attrs["fn"], "has_bias": bool(lin.attrs.get("has_bias")),
                     **quant_attrs(lin.attrs)}
            if lin.attrs.get("out_dtype"):               # a row-parallel linear's fp32 partials
                attrs["out_dtype"] = lin.attrs["out_dtype"]
            g.add_node(Node(g.new_node_id("linear_act_mul"), "linear_act_mul",
                            [act.inputs[0]] + lin.inputs[1:], [out], attrs, lin.line,
                            fused_from=act.fused_from + ["linear"]), before=lin.id)
            g.replace_uses(lin.outputs[0], out)
            g.remove_node(lin.id)
            g.remove_node(act.id)
            state.note("fuse_linear_prologue", f"{g.name}: line {lin.line}")


def fuse_lm_head(state):
    """[softcap](linear(rms_norm(last([add](x, d))), w[, b])) -> lm_head_last: only each
    sequence's last token goes through the final norm and the vocabulary projection; the bias and
    the final logit softcap (Gemma2) run in its epilogue."""
    g = state.graph
    for lin in [n for n in g.ordered() if n.op == "linear" and not n.attrs.get("quant")]:
        norm = g.producer(lin.inputs[0])
        if norm is None or norm.op != "rms_norm" or not has_weight(norm) or _single_user(g, lin.inputs[0]) is None:
            continue
        last = g.producer(norm.inputs[0])
        if last is None or last.op != "last" or _single_user(g, norm.inputs[0]) is None:
            continue
        add = g.producer(last.inputs[0])
        residual = add is not None and add.op == "add" and _single_user(g, last.inputs[0]) is not None
        cap = _single_user(g, lin.outputs[0])
        cap = cap if cap is not None and cap.op == "softcap" else None
        xs = add.inputs if residual else [last.inputs[0]]
        out = _new(g, "logits", lin.line)
        fused_from = (["add"] if residual else []) + ["last", "rms_norm", "linear"] + \
            (["softcap"] if cap else [])
        has_bias = bool(lin.attrs.get("has_bias"))
        g.add_node(Node(g.new_node_id("lm_head_last"), "lm_head_last",
                        xs + [norm.inputs[1]] + lin.inputs[1:], [out],
                        {"eps": norm.attrs["eps"], "residual": residual,
                         "softcap": cap.attrs["cap"] if cap else None, "has_bias": has_bias},
                        lin.line, fused_from=fused_from), before=lin.id)
        g.replace_uses((cap or lin).outputs[0], out)
        for n in ([lin, norm, last] + ([add] if residual else []) + ([cap] if cap else [])):
            g.remove_node(n.id)
        extras = [w for w, on in (("the pending residual add", residual), ("bias", has_bias),
                                  ("softcap", cap)) if on]
        state.note("fuse_lm_head", f"line {lin.line}{' with ' + ', '.join(extras) if extras else ''}")
