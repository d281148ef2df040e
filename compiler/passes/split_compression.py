"""DeepSeek-V4's indexer_topk and compressed_attention -> compress_write, compress_carry, then a
cached reader (indexer_topk_cached, compressed_attention_cached): the generic lowering, as
split_attention's.

Each query reads the compressed entries its own step completes, so in one launch the kernel had
to compress a sequence's rows before any of its queries (one program a sequence, every query of
a 1k prefill on one SM). Split, each launch is a program a token row: compress_write computes the
entry of each block a row completes (its rows from the step's input, or from the slot's partial
blocks for rows of earlier steps; compressed_attention's also writes the window's rows, swa),
compress_carry then puts the step's rows into the slot (after: they overwrite the rows the
entries read), and the readers run a program a query token. Cache markers order the three.
"""
from ..ir import Node, Value

COMPRESSOR = ("rate", "cache", "eps", "theta", "scaling", "rotary_dim")


def _write(g, n, inputs):
    marker = g.fresh("cache")
    g.add_value(Value(marker, "act", line=n.line))
    attrs = {a: n.attrs.get(a) for a in COMPRESSOR}
    if len(inputs) == 5:
        attrs["has_rows"] = True
    g.add_node(Node(g.new_node_id("compress_write"), "compress_write", inputs, [marker], attrs, n.line,
                    fused_from=[n.op]), before=n.id)
    carried = g.fresh("cache")
    g.add_value(Value(carried, "act", line=n.line))
    overlap = g.values[inputs[0]].type.shape[1] == 2 * g.values[inputs[3]].type.shape[0]
    g.add_node(Node(g.new_node_id("compress_carry"), "compress_carry", [*inputs[:3], marker], [carried],
                    {"rate": attrs["rate"], "cache": attrs["cache"], "overlap": overlap}, n.line,
                    fused_from=[n.op]), before=n.id)
    return carried


def _reader(g, n, op, inputs, attrs, name):
    out = g.fresh(name)
    g.add_value(Value(out, "act", line=n.line))
    g.add_node(Node(g.new_node_id(op), op, inputs, [out], attrs, n.line, fused_from=[n.op]), before=n.id)
    g.replace_uses(n.outputs[0], out)
    g.remove_node(n.id)


def split_compression(state):
    for g in state.graph.walk():
        for n in [n for n in g.ordered() if n.op == "indexer_topk"]:
            q, w, kv, gate, bias, norm = n.inputs
            marker = _write(g, n, [kv, gate, bias, norm])
            _reader(g, n, "indexer_topk_cached", [q, w, marker],
                    {a: n.attrs[a] for a in ("rate", "topk", "cache")}, "idx")
            state.note("split_compression", f"{g.name}: line {n.line}")
        for n in [n for n in g.ordered() if n.op == "compressed_attention"]:
            q, kv, sinks, ckv, cgate, cbias, cnorm, *index = n.inputs
            marker = _write(g, n, [ckv, cgate, cbias, cnorm, kv])
            attrs = {a: n.attrs.get(a) for a in ("rate", "window", "scale", "cache")}
            if index:
                attrs["has_index"] = True
            _reader(g, n, "compressed_attention_cached", [q, marker, sinks, *index], attrs, "attn")
            state.note("split_compression", f"{g.name}: line {n.line}")
