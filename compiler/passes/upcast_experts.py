"""Quantized experts dequantized once a layer for the grouped GEMMs of many-token steps.

A grouped expert GEMM over quantized codes dequantizes each weight tile in its registers
(tl.dot_scaled on sm_90 upcasts MXFP4 through shared memory) once per row block of an expert's
tokens: at prefill sizes every expert has several blocks, and GPT-OSS-20B's gate|up ran at ~166
TFLOP/s, a fifth of the bf16 tensor-core rate (H200, bench/NOTES.md). This pass gives each
quantized moe_gate_up / moe_down (weight-only 4-bit codes: `upcasts`) a launch before it that
writes the stack in bf16 once
(ops/expert_upcast.py), read by the grouped GEMMs (the unquantized tile, at the bf16 rate) in
steps of at least `rows` rows; below that the GEMMs read the codes as before, since an expert
with a block or two of tokens dequantizes each tile about once anyway and the upcast's write and
re-read of the bf16 stack would cost more than it saves:

    moe_gate_up(x, ids, W:codes, rows, counts, ..., w_scale[, w_zero][, a_scale])
 -> Wb = expert_upcast(W, w_scale[, w_zero])                   (rows = R, dim = T or G)
    moe_gate_up(x, ids, W:codes, rows, counts, ..., w_scale[, w_zero][, a_scale], Wb)
                attrs has_w_upcast, upcast_rows = R

R = the step rows at which the routed experts get infc/config.py's UPCAST_TOKENS_PER_EXPERT
tokens each on average (R k / E, E the model's routed experts, k the slots a token: under expert
parallelism the ids name the whole model's experts). The decision is the step's: the upcast
launch's grid is empty below R (runtime/cuda/runner.py skips it) and the GEMM branches on its T
argument, so the one program serves both. Only the prefill and mixed programs launch it
(ops/expert_upcast.py UPCAST_PHASES; the decode programs, wide's grouped GEMMs included, read the
codes); Wb lives in the arena, one buffer reused by every layer and by
gate|up and down in turn (liveness: plan_memory), E x N x K x 2 bytes for the larger stack,
shown by `infc inspect`. A stack larger than UPCAST_MAX_BYTES keeps the codes at every size.

Resident mode (infc/config.py RESIDENT_EXPERT_STACKS_MAX_BYTES: the model's upcast stacks, every
layer's, fit under it in bf16): Wb is a derived weight `<W>_bf16` a layer (source {"derived":
...}, runtime/weights/recipes.py), written once by an expert_upcast launch of the load program
(attrs at_load, rows 1: its grid is never empty; compiler/passes/select_kernels.py LOAD), and the
GEMMs carry attrs upcast_resident: the prefill, mixed, short and wide programs' grouped GEMMs read
it in steps of at least R rows (R from RESIDENT_TOKENS_PER_EXPERT, as above), the codes below;
the decode, narrow and verify GEMVs read the codes (ops/expert_upcast.py RESIDENT_PHASES). No step
launches an upcast, and the stacks' bytes are weights (the KV cache gets less).
"""
from ..ir import Node, TensorType, Value
from ..ops.quant import scheme_of
from .fuse_weights import register_weight
from .quantize_experts import EXPERT_OPS
from .select_kernels import LOAD_ATTR

IDS = {"moe_gate_up": 1, "moe_down": 2}                # op -> the input index of its expert ids


def _routed(g, n) -> tuple[int, int]:
    """(the model's routed experts, routed slots a token) of an expert launch (shared experts
    folded in as always-on ones serve every token: they are not counted)."""
    ids = g.values[n.inputs[IDS[n.op]]].type
    w = g.values[n.inputs[EXPERT_OPS[n.op]]].type
    route = g.producer(n.inputs[IDS[n.op]])
    shared = route.attrs.get("shared", 0) if route is not None and route.op.startswith("moe_route") else 0
    return w.shape[0] - shared, ids.shape[1] - shared


def upcasts(s) -> bool:
    """The schemes whose stacks this pass upcasts: weight-only 4-bit codes (MXFP4's e2m1, int4
    groups), where a tile's dequantization costs most and the grouped GEMM's tiles keep their
    bf16 defaults, so the kernel holding both tiles fits sm_90's shared memory (147,456 B for
    GPT-OSS-20B's gate|up at 3 stages). Not 8-bit codes: with activations quantized in groups of
    128 their K tiles are 128 deep, and the two tiles' pipelines (246,784 B for qwen3-30b-a3b's FP8
    blocks) are past the 232,448 B a block may use; an fp8 stack is half a bf16 one's bytes anyway,
    and its tile converts to bf16 at a conversion an element."""
    return s.codes in ("u4", "e2m1") and s.act == "none"


def _stack_bytes(t: TensorType) -> int:
    """A stack [E, N, K]'s bytes in bf16."""
    return 2 * t.shape[0] * t.shape[1] * t.shape[2]


def _qualifying(state):
    """(graph, node, scheme) of each expert launch this pass may give a bf16 stack, and the
    stacks' names past UPCAST_MAX_BYTES (kept on codes)."""
    from infc.config import UPCAST_MAX_BYTES
    out, big = [], []
    for g in state.graph.walk():
        for n in [n for n in g.ordered() if n.op in EXPERT_OPS and n.attrs.get("quant")]:
            if n.attrs.get("has_w_upcast"):
                continue
            s = scheme_of(n.attrs)
            if not upcasts(s):
                continue
            w_name = n.inputs[EXPERT_OPS[n.op]]
            nbytes = _stack_bytes(g.values[w_name].type)
            if nbytes > UPCAST_MAX_BYTES:
                big.append(f"{w_name} ({nbytes / 2 ** 30:.1f} GiB)")
                continue
            out.append((g, n, s))
    return out, big


def _resident_bytes(state, found) -> int:
    """The bf16 bytes of every qualifying stack, one copy a layer that has it (a weight several
    layer kinds read counts once)."""
    seen = {}
    for g, n, _ in found:
        w_name = n.inputs[EXPERT_OPS[n.op]]
        layers = state.weights[w_name]["layers"] if w_name in state.weights else None
        seen[w_name] = _stack_bytes(g.values[w_name].type) * (1 if layers is None else len(layers))
    return sum(seen.values())


def upcast_experts(state):
    from infc.config import (RESIDENT_EXPERT_STACKS_MAX_BYTES, RESIDENT_TOKENS_PER_EXPERT, UPCAST_EXPERTS,
                             UPCAST_MAX_BYTES, UPCAST_TOKENS_PER_EXPERT)
    found, big = _qualifying(state)
    total = _resident_bytes(state, found)
    resident = bool(found) and 0 < total <= RESIDENT_EXPERT_STACKS_MAX_BYTES \
        and all(g.values[n.inputs[EXPERT_OPS[n.op]]].kind == "weight" for g, n, _ in found)
    if not resident and not UPCAST_EXPERTS:     # off by default: infc/config.py says why
        return
    par = state.parallel or {}
    ep = par.get("ep", 1) if par.get("world", 1) > 1 else 1
    per_expert = RESIDENT_TOKENS_PER_EXPERT if resident else UPCAST_TOKENS_PER_EXPERT
    made = 0
    for g, n, s in found:
        w_name = n.inputs[EXPERT_OPS[n.op]]
        w = g.values[w_name].type
        E, k = _routed(g, n)
        # (at most int32's largest: the kernels compare it with their i32 T)
        rows = min(max(1, -(-per_expert * E * ep // k)), 2 ** 31 - 1)
        first = EXPERT_OPS[n.op] + 3 + (1 if n.attrs.get("has_bias") else 0)
        companions = dict(zip(s.companions(), n.inputs[first:]))
        inputs = [w_name] + [companions[c] for c in ("w_scale", "w_zero") if c in companions]
        has = {f"has_{c}": True for c in ("w_scale", "w_zero") if c in companions}
        dim = g.values[n.inputs[IDS[n.op]]].type.shape[0]
        if resident:
            # one derived weight a stack, written by the load program in each body that reads it
            upcast = w_name + "_bf16"
            if upcast not in g.values:
                if upcast not in state.weights:
                    register_weight(state, g, upcast, TensorType(w.shape, "bf16"),
                                    {"derived": {"by": "expert_upcast", "from": inputs, "shape": list(w.shape)}},
                                    state.weights[w_name]["layers"], n.line)
                else:
                    g.add_value(Value(upcast, "weight", TensorType(w.shape, "bf16"), line=n.line))
                g.add_node(Node(g.new_node_id("expert_upcast"), "expert_upcast", inputs, [upcast],
                                {"quant": n.attrs["quant"], "rows": 1, "dim": "T", **has, LOAD_ATTR: True},
                                n.line, fused_from=list(n.fused_from)), before=n.id)
        else:
            upcast = g.fresh(f"{w_name}_bf16")
            g.add_value(Value(upcast, "act", TensorType(w.shape, "bf16"), line=n.line))
            g.add_node(Node(g.new_node_id("expert_upcast"), "expert_upcast", inputs, [upcast],
                            {"quant": n.attrs["quant"], "rows": rows, "dim": dim, **has}, n.line,
                            fused_from=list(n.fused_from)),
                       before=n.id)
        n.inputs.append(upcast)
        n.attrs["has_w_upcast"] = True
        n.attrs["upcast_rows"] = rows
        if resident:
            n.attrs["upcast_resident"] = True
        made += 1
    if made or big:
        state.note("upcast_experts", f"{made} expert launches read a bf16 stack at many tokens"
                   + (f" (resident: {total / 2 ** 30:.2f} GiB of derived weights the load program writes)"
                      if resident else "")
                   + (f"; kept on codes (over {UPCAST_MAX_BYTES / 2 ** 30:.0f} GiB): {', '.join(big)}" if big else ""))
