"""attention(q, k, v) -> kv_write(k, v) then attention_cached(q, cache): the generic
implementation (not a fusion). The new rows must be in the cache before any query attends, so
the write and the attention are two launches; the `cache` marker value orders them.
"""
from ..ir import Node, Value
from ..ops.attention import EXTRA_ATTRS, alibi_max


def split_attention(state):
    for g in state.graph.walk():
        for att in [n for n in g.ordered() if n.op == "attention"]:
            q, k, v, *sinks = att.inputs
            if not att.attrs.get("causal", True):
                raise state.error("attention: only causal attention is implemented "
                                  "(causal=false is not supported)", att.line)
            marker = g.fresh("cache")
            g.add_value(Value(marker, "act", line=att.line))
            g.add_node(Node(g.new_node_id("kv_write"), "kv_write", [k, v], [marker], {}, att.line,
                            fused_from=["attention"]), before=att.id)
            out = g.fresh("attn")
            g.add_value(Value(out, "act", line=att.line))
            attrs = {"kv_heads": g.values[k].type.shape[1],
                     **{a: att.attrs.get(a) for a in ("scale", "window", "softcap")}}
            # extra attrs: carried only where the spec gives them (other plans unchanged)
            attrs.update({a: att.attrs[a] for a in EXTRA_ATTRS if att.attrs.get(a) is not None})
            if attrs.get("alibi") is not None:     # true -> BLOOM's max bias: one form for the kernels
                attrs["alibi"] = alibi_max(attrs["alibi"])
                if attrs["alibi"] is None:
                    del attrs["alibi"]
            if sinks:                    # an extra input: set only where the spec gives it
                attrs["has_sinks"] = True
            g.add_node(Node(g.new_node_id("attention_cached"), "attention_cached", [q, marker, *sinks], [out],
                            attrs, att.line, fused_from=["attention"]), before=att.id)
            g.replace_uses(att.outputs[0], out)
            g.remove_node(att.id)
            state.note("split_attention", f"{g.name}: line {att.line}")
