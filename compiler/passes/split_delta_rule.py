"""The chunked delta rule in two launches: the chunks' WY form first, all at once.

The chunked kernel (gated_delta_rule_chunk) walks a sequence's chunks in order, since each chunk
starts from the state the one before left. But most of a chunk's work does not need that state:
the unit lower-triangular solve (I + A)^-1 and the products W = (I + A)^-1 (beta k exp(G)),
U = (I + A)^-1 (beta v) read only the chunk's own k, v, g and beta. Solved on the sequential path,
the solve's row-by-row substitution is most of it (Qwen3.5-4B: a program a v-head and v block,
64 programs for a whole prompt on a 132-SM card). This pass takes it off that path:

    o = gated_delta_rule(q, k, v, g, beta[, dt_bias, A])
 -> W, U = delta_rule_wy(k, v, g, beta[, dt_bias, A], chunk=C)       (a program a chunk and v-head)
    o = gated_delta_rule(q, k, v, g, beta[, dt_bias, A], W, U, chunk=C)

The rule's value is unchanged (its reference ignores W and U); its chunked kernels read them and
keep only the products with the state. delta_rule_wy is launched by the programs whose rule runs
the chunked kernel (ops/linear_attention.py WY_PHASES); the decode programs' recurrent kernel
reads neither. W and U are f32 [T, Hv, Dk] and [T, Hv, Dv] in the arena, one pair every layer
reuses (Qwen3.5-4B: 32 KiB a step token, 0.27 GB at the server's 8,192-token steps; `infc inspect`
shows the arena). infc/config.py DELTA_WY switches the pass, DELTA_CHUNK sets C (H100, Qwen3.5-4B:
TTFT at 1k 42.6 ms in one launch, 24.5 in two with chunks of 64, 21.6-22.0 with 32; bench/NOTES.md).
"""
from ..ir import Node, Value


def split_delta_rule(state):
    from infc.config import DELTA_CHUNK, DELTA_WY
    if not DELTA_WY:
        return
    for g in state.graph.walk():
        for rule in [n for n in g.ordered() if n.op == "gated_delta_rule" and not n.attrs.get("has_wy_w")]:
            gates = rule.attrs.get("gates")
            ins = rule.inputs[1:5] + (rule.inputs[5:7] if gates is not None else [])
            attrs = {"chunk": DELTA_CHUNK,
                     **{a: rule.attrs[a] for a in ("gates", "qk_norm", "has_dt_bias", "has_A")
                        if rule.attrs.get(a) is not None}}
            outs = [g.fresh("wy_w"), g.fresh("wy_u")]
            for o in outs:
                g.add_value(Value(o, "act", line=rule.line))
            g.add_node(Node(g.new_node_id("delta_rule_wy"), "delta_rule_wy", ins, outs, attrs, rule.line,
                            fused_from=["gated_delta_rule"]), before=rule.id)
            rule.inputs = rule.inputs + outs
            rule.attrs.update(has_wy_w=True, has_wy_u=True, chunk=DELTA_CHUNK)
            state.note("split_delta_rule", f"{g.name}: line {rule.line}")
