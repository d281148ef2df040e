"""An fp8 linear's activation codes made once a step, by their producer.

A linear whose weight is e4m3 codes and whose format quantizes its activations (dynamic_group,
dynamic_token, static: compiler/ops/quant.py) used to quantize its A rows inside its own launch,
in every program that reads them: BLOCK_N or tile-count times the same amax, division and e4m3
rounding (bench/NOTES.md, issue 42: the e4m3 dot with ready codes streams at 37-84 % of the
weights' floor, 5-16 % quantizing in every tile). This pass makes the codes and their scales
tensors of the plan, computed once, and has the linear read them:

    h = producer(...)                      h, codes, s = add_rms_norm_quant(x, d, w)
    y = linear(h, W, ...)          ->      (where h comes from add_rms_norm: the row is whole in
                                            one program, so its epilogue quantizes it)
                                           codes, s = quantize_act(h[, x_scale])   (else)
                                           y = linear(codes, W, ..., s)   attrs.has_a_scale

codes * s is the quantizer's output bit for bit (the same definition, the same IEEE division
and e4m3 rounding), so the linear's sums are the same as before. Linears reading the same x with
the same activation scheme share one quantize_act. The bf16 h stays written (the residual
stream's norm may have other readers; a dead one costs a row's store).

Consumers: linear and linear_gated (their GEMV and GEMM templates read codes in every path),
and the routed experts' moe_gate_up (x: the token rows, whose codes every chosen expert shares:
usually the mlp norm's add_rms_norm writes them) and moe_down (act [T, k, F]: one quantize_act
over the chosen experts' rows; moe_gate_up's programs each hold a few of a group's columns, so
its epilogue cannot take a group's amax). Their decode kernels then dot e4m3 codes on tensor
cores, their grouped kernels read code * scale (triton/moe_*.py.j2).
Not rewritten (they keep quantizing in their own launch): linear_act_mul (its A is built in its
load from gate|up), act-order (g_idx) and weight-only schemes, static experts (the expert
templates refuse them), and act groups the producers do not tile (not a power of two from 16 to
1024; 512 for the experts' tiles).
"""
from ..ir import Node
from ..ops.quant import reads_codes, scheme_of
from .fuse_ops import _new

CONSUMERS = ("linear", "linear_gated", "moe_gate_up", "moe_down")
EXPERTS = ("moe_gate_up", "moe_down")
# the act groups the producers' kernels tile (a [groups, act_group] tile: triton/_act_codes.j2's
# users); a linear with another group (16 x 48 test blocks) keeps quantizing in its own launch
GROUPS = (16, 32, 64, 128, 256, 512, 1024)
EXPERT_GROUPS = GROUPS[:-1]     # (triton/_quant.j2 expert_setup: an expert K tile holds whole groups)
FUSED_PRODUCERS = {"add_rms_norm": "add_rms_norm_quant"}   # op -> its form with codes, h = output 1


def _x_scale(n, s):
    """The consumer's x_scale input (static activations), else None."""
    if s.act != "static":
        return None
    first = 3 if n.attrs.get("has_bias") else 2
    return n.inputs[first + s.companions().index("x_scale")]


def _fused(state, g, x, s, line):
    """(codes, scales) from x's producer when it holds whole rows (add_rms_norm's h), else None."""
    p = g.producer(x)
    if p is None or p.op not in FUSED_PRODUCERS or p.outputs[1] != x or s.act == "static":
        return None
    codes, scales = _new(g, "codes", line), _new(g, "a_scale", line)
    q = Node(g.new_node_id(FUSED_PRODUCERS[p.op]), FUSED_PRODUCERS[p.op], list(p.inputs),
             list(p.outputs) + [codes, scales], {**p.attrs, "act_quant": s.attrs()}, p.line,
             fused_from=list(p.fused_from))
    g.add_node(q, before=p.id)              # (the outputs keep their names and values)
    g.remove_node(p.id)
    state.note("act_codes", f"{g.name}: {p.op} (line {p.line}) writes {x}'s codes")
    return codes, scales


def make_act_codes(state):
    if state.quant is None:
        return
    for g in state.graph.walk():
        made = {}
        for n in list(g.ordered()):
            if n.op not in CONSUMERS or n.attrs.get("has_a_scale"):
                continue
            s = scheme_of(n.attrs)
            x = n.inputs[0]
            if not reads_codes(s) or g.values[x].type.dtype != "bf16" \
                    or s.act == "dynamic_group" and s.act_group not in GROUPS:
                continue
            if n.op in EXPERTS and (s.act == "static" or s.act == "dynamic_group"
                                    and s.act_group not in EXPERT_GROUPS):
                continue
            xs = _x_scale(n, s)
            key = (x, s.act, s.act_group, xs)
            if key not in made:
                made[key] = _fused(state, g, x, s, n.line)
            if made[key] is None:
                codes, scales = _new(g, "codes", n.line), _new(g, "a_scale", n.line)
                g.add_node(Node(g.new_node_id("quantize_act"), "quantize_act",
                                [x] + ([xs] if xs else []), [codes, scales],
                                {"act_quant": s.attrs(), **({"has_x_scale": True} if xs else {})},
                                n.line, fused_from=[]), before=n.id)
                made[key] = codes, scales
                state.note("act_codes", f"{g.name}: quantize_act before {n.op} (line {n.line})")
            codes, scales = made[key]
            n.inputs = [codes] + n.inputs[1:] + [scales]
            n.attrs["has_a_scale"] = True
