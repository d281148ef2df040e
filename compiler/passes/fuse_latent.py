"""fuse_latent_prologue: MLA's query and latent row in one launch.

A DeepSeek-style spec builds latent_attention's two inputs from five small ops:
    q  = concat(q_lat, rope(view(q_pe)))                      q_lat: the absorbed nope query
    kv = concat(rms_norm(c_kv, kv_norm), view(rope(view(k_pe))))   c_kv, k_pe = split(kv_a)
Both become latent_prologue(q_lat, view(q_pe), kv_a, kv_norm) -> (q, kv) (ops/latent_prologue.py),
one launch a layer instead of five (at batch 1 those five cost DeepSeek-V2-Lite ~0.13 ms a token on
an H200: bench/NOTES.md, the drop-launch bounds). The rewrite needs every intermediate used once
and the two ropes alike; anything else is left as written.
"""
from ..ir import Node
from ..ops.rms_norm import has_weight
from .fuse_ops import _new, _only, _single_user


def _match(g, q_cat, kv_cat):
    """The nodes of the two chains and the fused op's inputs, or None."""
    q_lat, q_rot = q_cat.inputs
    rope_q = _only(g, q_rot, "rope")
    normed, k_rot = kv_cat.inputs
    norm = _only(g, normed, "rms_norm")
    k_view = _only(g, k_rot, "view")
    rope_k = k_view and _only(g, k_view.inputs[0], "rope")
    k_in = rope_k and _only(g, rope_k.inputs[0], "view")
    if not (rope_q and norm and rope_k and k_in) or rope_q.attrs != rope_k.attrs or not has_weight(norm):
        return None
    split = g.producer(norm.inputs[0])
    if split is None or split.op != "split" or split.outputs != [norm.inputs[0], k_in.inputs[0]] \
            or any(_single_user(g, v) is None for v in split.outputs):
        return None
    return [rope_q, norm, k_view, rope_k, k_in, split, kv_cat, q_cat], \
        [q_lat, rope_q.inputs[0], split.inputs[0], norm.inputs[1]], {"eps": norm.attrs["eps"], **rope_q.attrs}


def fuse_latent_prologue(state):
    for g in state.graph.walk():
        for att in [n for n in g.ordered() if n.op == "latent_attention"]:
            q_cat, kv_cat = (g.producer(v) for v in att.inputs[:2])
            if q_cat is None or kv_cat is None or q_cat.op != "concat" or kv_cat.op != "concat":
                continue
            found = _match(g, q_cat, kv_cat)
            if found is None:
                continue
            nodes, inputs, attrs = found
            # the fused node takes q's concat's place: kv's concat comes before it, so every user of
            # kv must come after it
            at = g.order.index(q_cat.id)
            if any(g.order.index(u.id) < at for u in g.users(kv_cat.outputs[0])):
                continue
            q, kv = _new(g, "q", q_cat.line), _new(g, "kv", kv_cat.line)
            g.add_node(Node(g.new_node_id("latent_prologue"), "latent_prologue", inputs, [q, kv], attrs,
                            q_cat.line, fused_from=["rope", "rms_norm", "view", "rope", "view", "split",
                                                    "concat", "concat"]), before=q_cat.id)
            g.replace_uses(q_cat.outputs[0], q)
            g.replace_uses(kv_cat.outputs[0], kv)
            for n in nodes:
                g.remove_node(n.id)
            state.note("fuse_latent_prologue", f"{g.name}: line {att.line}")
