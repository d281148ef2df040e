"""The gated delta rule takes in its own launch what Qwen3.5 and Qwen3-Next compute before it:

fuse_delta_gates, its gates:
    beta = sigmoid(b)
    g = mul(softplus(add(a, dt_bias)), A)        a, b: the gate projections' [T, Hv] outputs
    o = gated_delta_rule(q, k, v, g, beta)
 -> o = gated_delta_rule(q, k, v, a, b, dt_bias, A, gates=<beta's dtype>)
Five launches a layer fewer (the sigmoid, the add, the softplus, the mul, and the copy that made
a contiguous for the add: the delta rule's kernels read a and b as the strided views of the fused
projection they are). The same arithmetic in the same order: g's chain is f32 from the
add on (dt_bias is f32) and is fused only where it is, and beta is rounded to the sigmoid's
output dtype inside the kernel, as that launch's store did.

fuse_delta_norms, its q and k norms:
    o = gated_delta_rule(l2_norm(q, eps), l2_norm(k, eps), ...)     (f32 outputs: never rounded)
 -> o = gated_delta_rule(q, k, ..., qk_norm=eps)
Two launches a layer fewer; each row's x * rsqrt(sum(x^2) + eps) as the l2_norm kernel computes it
(its sum's order is the kernel's own). compiler/ops/linear_attention.py defines both forms.
"""
from .fuse_ops import _activation, _single_user


def _gate_weight(g, name: str, heads) -> bool:
    """A per-head f32 weight [Hv] (dt_bias, A)."""
    v = g.values[name]
    return v.kind == "weight" and v.type is not None and v.type.dtype == "f32" and tuple(v.type.shape) == heads


def _f32(g, value: str) -> bool:
    t = g.values[value].type
    return t is not None and t.dtype == "f32"


def _on() -> bool:
    from infc.config import FUSE_DELTA_RULE
    return FUSE_DELTA_RULE


def fuse_delta_gates(state):
    if not _on():
        return
    for g in state.graph.walk():
        for rule in [n for n in g.ordered() if n.op == "gated_delta_rule" and n.attrs.get("gates") is None]:
            gv, bv = rule.inputs[3], rule.inputs[4]
            heads = tuple(g.values[rule.inputs[2]].type.shape[1:2])
            sig = g.producer(bv)
            if _activation(sig) != "sigmoid" or _single_user(g, bv) is None:
                continue
            mul = g.producer(gv)
            if mul is None or mul.op != "mul" or _single_user(g, gv) is None or not _f32(g, gv):
                continue
            sp, A = next(((x, w) for x, w in (mul.inputs, mul.inputs[::-1])
                          if _activation(g.producer(x)) == "softplus" and _gate_weight(g, w, heads)), (None, None))
            if sp is None or _single_user(g, sp) is None or not _f32(g, sp):
                continue
            soft = g.producer(sp)
            add = g.producer(soft.inputs[0])
            if add is None or add.op != "add" or _single_user(g, soft.inputs[0]) is None or not _f32(g, soft.inputs[0]):
                continue
            a, dt_bias = next(((x, w) for x, w in (add.inputs, add.inputs[::-1]) if _gate_weight(g, w, heads)),
                              (None, None))
            if a is None:
                continue
            rule.inputs = rule.inputs[:3] + [a, sig.inputs[0], dt_bias, A] + rule.inputs[5:]
            rule.attrs.update(gates=g.values[bv].type.dtype, has_dt_bias=True, has_A=True)
            rule.fused_from = rule.fused_from + ["sigmoid", "add", "softplus", "mul"]
            for n in (sig, mul, soft, add):
                g.remove_node(n.id)
            state.note("fuse_delta_gates", f"{g.name}: line {rule.line}")


def fuse_delta_norms(state):
    if not _on():
        return
    for g in state.graph.walk():
        for rule in [n for n in g.ordered() if n.op == "gated_delta_rule" and n.attrs.get("qk_norm") is None]:
            norms = [g.producer(x) for x in rule.inputs[:2]]
            if any(n is None or n.op != "l2_norm" or _single_user(g, x) is None or not _f32(g, x)
                   for n, x in zip(norms, rule.inputs[:2])) or norms[0].attrs["eps"] != norms[1].attrs["eps"]:
                continue
            rule.inputs = [norms[0].inputs[0], norms[1].inputs[0]] + rule.inputs[2:]
            rule.attrs["qk_norm"] = norms[0].attrs["eps"]
            rule.fused_from = rule.fused_from + ["l2_norm", "l2_norm"]
            for n in norms:
                g.remove_node(n.id)
            state.note("fuse_delta_norms", f"{g.name}: line {rule.line}")
