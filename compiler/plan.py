"""The plan: everything the runtime needs from the model, as versioned, byte-deterministic JSON.

    config      bound config symbols
    weights     name -> shape, dtype, per_layer, source (how to build it from checkpoint tensors)
    kv_cache    layers, kv heads, head dim, dtype
    arena       bytes as bytes_per_token*T + bytes_per_seq*B + bytes
    buffers     value -> shape, dtype, offset {T, B, bytes} (views: col_offset, row_stride)
    programs    phase -> ordered launches; {"repeat": "layers", ...} runs its body L times
"""
import json

from .ir import Graph
from .ops import REGISTRY
from .passes.plan_memory import DTYPE_BYTES

SCHEMA = "infc.plan/1"
KV = "kv_cache"
STEP_METADATA = {
    "positions": {"shape": ["T"], "dtype": "i32", "doc": "absolute position of each token"},
    "seq_starts": {"shape": ["B+1"], "dtype": "i32", "doc": "first token row of each sequence"},
    "context_lens": {"shape": ["B"], "dtype": "i32", "doc": "KV length after this step"},
    "last_rows": {"shape": ["B"], "dtype": "i32", "doc": "row of each sequence's last token"},
    "slot_mapping": {"shape": ["T"], "dtype": "i32", "doc": "KV slot each new token writes"},
    "block_tables": {"shape": ["B", "max_pages"], "dtype": "i32", "doc": "KV pages per sequence"},
}


def _jsonable(v):
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    return str(v)


def _buffers(state) -> dict:
    out = {}
    for g in state.graph.walk():
        for n in g.ordered():
            for o in n.outputs:
                v = g.values[o]
                if v.type is None:
                    continue
                out[o] = _buffer(state, g, o)
        for i in g.inputs:          # step inputs, and a layer body's carried inputs
            out[i] = _buffer(state, g, i)
    # in the order values were declared (inputs, then each graph's values): stable and readable
    order = {}
    for g in state.graph.walk():
        for v in g.values:
            order.setdefault(v, len(order))
    return {k: out[k] for k in sorted(out, key=lambda k: order.get(k, len(order)))}


def _buffer(state, g: Graph, name: str) -> dict:
    mem = state.memory
    v = g.values[name]
    root = mem["root"][name]
    t, b, c = mem["slot_offsets"][mem["slot_of"][root]]
    entry = {"shape": list(v.type.shape), "dtype": v.type.dtype}
    col, cur = 0, name
    while g.values[cur].alias_of is not None:
        p = g.producer(cur)
        if p is not None and p.op == "split":
            k = p.outputs.index(cur)
            col += sum(p.attrs["sizes"][:k])
            entry["row_stride"] = sum(p.attrs["sizes"])
        cur = g.values[cur].alias_of
    entry["offset"] = {"T": t, "B": b, "bytes": c + col * DTYPE_BYTES[v.type.dtype]}
    if root != name:
        entry["shares"] = root
    return entry


def _launches(state, g: Graph, phase: str) -> list:
    out = []
    for n in g.ordered():
        if n.op == "layers":
            out.append({"repeat": "layers", "count": n.attrs["count"],
                        "carried": {o: i for o, i in n.body.carried.items()},
                        "inputs": n.inputs, "outputs": n.outputs,
                        "body": _launches(state, n.body, phase)})
            continue
        if REGISTRY[n.op].view:
            continue
        backend, template = state.kernels[phase][n.id]
        name = lambda x: KV if g.values[x].kind == "marker" else x  # noqa: E731
        out.append({"op": n.op, "kernel": template, "backend": backend,
                    "inputs": [name(i) for i in n.inputs], "outputs": [name(o) for o in n.outputs],
                    "attrs": _jsonable(n.attrs), "fuses": n.fused_from, "pass": n.made_by,
                    "line": n.line})
    return out


def emit_plan(state) -> dict:
    env = state.env
    weights = {}
    for g in state.graph.walk():
        for v in g.values.values():
            if v.kind == "weight":
                w = state.weights[v.name]
                weights[v.name] = {"shape": list(v.type.shape), "dtype": v.type.dtype,
                                   "per_layer": w["per_layer"], "source": w["source"]}
    buffers = _buffers(state)
    clash = set(buffers) & set(weights)
    assert not clash, f"buffer and weight names clash: {clash}"
    a = state.memory["arena"]
    kv = {}
    for g in state.graph.walk():
        for n in g.ordered():
            if n.op in ("qk_norm_rope_cache", "attention"):
                qk = n.attrs if n.op == "qk_norm_rope_cache" else None
                k_type = g.values[n.inputs[1]].type if n.op == "attention" else None
                kv = {"layers": env.get("L", 1),
                      "kv_heads": qk["kv_heads"] if qk else k_type.shape[1],
                      "head_dim": qk["head_dim"] if qk else k_type.shape[2],
                      "dtype": "bf16", "max_len": env.get("max_len")}
    g = state.graph
    return {
        "schema": SCHEMA,
        "model": state.model,
        "family": state.spec.family,
        "architectures": state.spec.architectures,
        "config": _jsonable({k: v for k, v in env.items()}),
        "inputs": {i: buffers[i] for i in g.inputs},
        "step_metadata": STEP_METADATA,
        "outputs": dict(zip(g.output_names, g.outputs)),
        "weights": weights,
        "kv_cache": kv,
        "arena": {"bytes_per_token": a[0], "bytes_per_seq": a[1], "bytes": a[2]},
        "buffers": buffers,
        "programs": {phase: _launches(state, g, phase) for phase in state.kernels},
    }


def dumps(plan: dict) -> str:
    return json.dumps(plan, indent=1, ensure_ascii=True) + "\n"
