"""fold_shared_experts: a MoE layer's always-on shared experts become extra routed experts.

DeepSeek-style MoE layers add a dense SwiGLU (the shared experts, intermediate size Fs) to the
routed experts' sum:
    y = moe_experts(h, w, ids, gate[E, Fe, H], up[E, Fe, H], down[E, H, Fe])
        + down_s @ (silu(gate_s @ h) * (up_s @ h))          gate_s, up_s [Fs, H], down_s [H, Fs]
A SwiGLU's sum over its intermediate units splits over any partition of them, so with
Fs = n * Fe the shared MLP is n experts of the routed experts' shape, each weighing 1:
    y = moe_experts(h, [w | 1 .. 1], [ids | E .. E+n-1], [gate; gate_s as [n, Fe, H]], ...)
The router (moe_route, attr shared = n) appends the n always-on slots, and the stacks gain the
shared chunks at load time (weight recipes: reshape, slice, concat). At batch-1 decode that is
the shared gate|up GEMV, the shared down GEMV and the add gone (three launches a MoE layer), and
the shared weights stream inside the expert kernels, which are wider launches.

Matched only where the rewrite is plainly the same function: the shared SwiGLU written as
linear(mul(ACT(linear(h, gate_s)), linear(h, up_s)), down_s) with no biases or output dtypes,
ACT the experts' own activation (silu; or DeepSeek-V4's clamped_silu, the shared MLP written
silu(clamp(gate, max=L)) * clamp(up, -L, L) with the experts' own limit L), every intermediate
used once, the add's other input the moe_experts output itself, the routing weights and ids
moe_route's own outputs, or moe_route_table's where it weighs by the router's logits (so not after
an expert-parallel or data-parallel dispatch, whose ids name ranks' experts), and Fs a multiple of
Fe. Anything else (a gated shared expert as Qwen2-MoE's, a tensor-parallel rank's partial sums)
is left as written. So are the experts of a quantized checkpoint that quantizes any of them
(Kimi-K2: int4 routed experts, bf16 shared ones): a stack mixing both would be neither, so the
shared experts stay plain linears, which quantize_weights reads as the checkpoint stores them.
"""
from ..ir import TensorType
from .fuse_ops import _activation, _only, _single_user
from .fuse_weights import forget_unread, register_weight


def _plain_linear(n) -> bool:
    return n is not None and n.op == "linear" and len(n.inputs) == 2 and not n.attrs.get("has_bias") \
        and not n.attrs.get("out_dtype")


def _clamped(g, value, lo, hi):
    """The single-use clamp(x, min=lo, max=hi) node producing `value`, or None."""
    c = _only(g, value, "clamp")
    if c is None or c.attrs.get("min") != lo or c.attrs.get("max") != hi:
        return None
    return c


def _shared_mlp(g, value, h, limit=None):
    """[down, mul, act, gate, up, clamps...] nodes of a SwiGLU of `h` producing `value`, or None.
    limit: DeepSeek-V4's clamped form, the experts' act "clamped_silu" (compiler/ops/gated_act.py),
    silu(clamp(gate, max=limit)) * clamp(up, -limit, limit)."""
    down = _only(g, value, "linear")
    mul = down and _only(g, down.inputs[0], "mul")
    if not _plain_linear(down) or mul is None or len(mul.inputs) != 2:
        return None
    for a, b in (mul.inputs, mul.inputs[::-1]):
        act = g.producer(a)
        if _activation(act) != "silu" or _single_user(g, a) is None:
            continue
        gate_in, up_in, clamps = act.inputs[0], b, []
        if limit is not None:
            cg, cu = _clamped(g, gate_in, None, limit), _clamped(g, up_in, -limit, limit)
            if cg is None or cu is None:
                continue
            gate_in, up_in, clamps = cg.inputs[0], cu.inputs[0], [cg, cu]
        gate, up = _only(g, gate_in, "linear"), _only(g, up_in, "linear")
        if _plain_linear(gate) and _plain_linear(up) and gate is not up and gate.inputs[0] == up.inputs[0] == h:
            return [down, mul, act, gate, up] + clamps
    return None


def _route_folds(g, route, experts) -> bool:
    """The router whose outputs are the experts' weights and ids, unshared yet, and able to append
    always-on slots: moe_route, or moe_route_table with the router's logits (E from them)."""
    if route is None or route.attrs.get("shared") or route.outputs != [experts.inputs[1], experts.inputs[2]] \
            or any(_single_user(g, v) is not experts for v in route.outputs):
        return False
    return route.op == "moe_route" or (route.op == "moe_route_table" and bool(route.attrs.get("has_logits")))


def _folded_name(name: str) -> str:
    """we_gate -> wes_gate: the expert stack with the shared experts after it."""
    stem, _, role = name.rpartition("_")
    return f"{stem}s_{role}" if stem else f"{name}s"


def _fold(state, g, experts, add, shared_nodes):
    x, w, ids, gate, up, down = experts.inputs
    route = g.producer(ids)
    down_s, gate_s, up_s = shared_nodes[0], shared_nodes[3], shared_nodes[4]
    E, Fe, H = g.values[gate].type.shape
    Fs = g.values[gate_s.inputs[1]].type.shape[0]
    n = Fs // Fe
    src = lambda v: state.weights[v]["source"]                            # noqa: E731
    layers = state.weights[gate]["layers"]
    dtype = g.values[gate].type.dtype
    new = {}
    for stack, shared in ((gate, gate_s.inputs[1]), (up, up_s.inputs[1])):
        new[stack] = _folded_name(stack)
        register_weight(state, g, new[stack], TensorType((E + n, Fe, H), dtype),
                        {"concat": [src(stack), {"reshape": src(shared), "from": [Fs, H], "to": [n, Fe, H]}],
                         "axis": 0}, layers)
    ws_down = down_s.inputs[1]
    chunks = [{"reshape": {"slice": src(ws_down), "axis": 1, "start": c * Fe, "stop": (c + 1) * Fe},
               "from": [H, Fe], "to": [1, H, Fe]} for c in range(n)]
    new[down] = _folded_name(down)
    register_weight(state, g, new[down], TensorType((E + n, H, Fe), dtype),
                    {"concat": [src(down)] + chunks, "axis": 0}, layers)
    route.attrs["shared"] = n
    experts.inputs = [x, w, ids, new[gate], new[up], new[down]]
    experts.fused_from = list(experts.fused_from or [experts.op]) + ["linear", "silu", "linear", "mul", "linear", "add"] \
        + ["clamp"] * (len(shared_nodes) - 5)
    g.replace_uses(add.outputs[0], experts.outputs[0])
    dropped = {gate, up, down, gate_s.inputs[1], up_s.inputs[1], ws_down}
    for nd in [add] + shared_nodes:
        g.remove_node(nd.id)
    for v in dropped:
        if g.uses(v) == 0:
            del g.values[v]
    state.note("fold_shared_experts", f"{g.name}: line {add.line}: {n} shared experts of {Fe} -> experts "
                                      f"{E}..{E + n - 1} ({', '.join(new.values())})")
    return dropped


def _quantized(state, weights) -> bool:
    """Whether the checkpoint stores any tensor of these weights quantized."""
    from .quantize_weights import _WEIGHT, _checkpoint_tensors
    if state.quant is None:
        return False
    return any(state.quant.scheme_for(t[:-len(_WEIGHT)].replace("{i}", "0").replace("{e}", "0")) is not None
               for w in weights for t in _checkpoint_tensors(state.weights[w]["source"]) if t.endswith(_WEIGHT))


def fold_shared_experts(state):
    dropped: set = set()
    for g in state.graph.walk():
        for experts in [n for n in g.ordered() if n.op == "moe_experts"]:
            y = experts.outputs[0]
            add = _single_user(g, y)
            if add is None or add.op != "add" or len(add.inputs) != 2:
                continue
            other = add.inputs[1] if add.inputs[0] == y else add.inputs[0]
            if other == y:
                continue
            act = experts.attrs.get("act", "silu")
            if len(experts.inputs) != 6 or act not in ("silu", "clamped_silu") \
                    or experts.attrs.get("weigh", "output") != "output":
                continue                 # biased or other-activation experts: a shared MLP differs
            limit = experts.attrs.get("limit") if act == "clamped_silu" else None
            if act == "clamped_silu" and not isinstance(limit, (int, float)):
                continue
            shared = _shared_mlp(g, other, experts.inputs[0], limit)
            if shared is None or not _route_folds(g, g.producer(experts.inputs[2]), experts):
                continue
            E, Fe, _ = g.values[experts.inputs[3]].type.shape
            gate_s, up_s, down_s = shared[3].inputs[1], shared[4].inputs[1], shared[0].inputs[1]
            if any(g.values[v].kind != "weight" or g.uses(v) != 1 for v in (gate_s, up_s, down_s)) \
                    or any(g.uses(v) != 1 for v in experts.inputs[3:]):
                continue
            if _quantized(state, list(experts.inputs[3:]) + [gate_s, up_s, down_s]):
                continue
            Fs = g.values[gate_s].type.shape[0]
            if Fs % Fe or g.values[gate_s].type.dtype != g.values[experts.inputs[3]].type.dtype:
                continue
            dropped |= _fold(state, g, experts, add, shared)
    forget_unread(state, dropped)
