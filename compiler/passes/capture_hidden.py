"""The target's hidden states for a speculation head, as a plan output (issue 43): the capability
behind `--speculative-config '{"method": "eagle3", ...}'` (and, with one layer, MTP's).

With state.capture = [l_0, l_1, ...] (layer indices), the plan gains the output

    aux_hidden [T, n*H]: for each token of the step, the residual stream entering layer l_j
                         in columns [j*H, (j+1)*H)

The layer loop carries one more value, aux (zeros before the loop), and every layer body starts
with `aux = capture_hidden(x, aux, layers)`, which writes its columns at the listed layers only
(compiler/ops/capture_hidden.py). "Entering layer l" is the output of layer l - 1: vLLM's and
SpecForge's EAGLE-3 convention (layer l's input, hidden + residual), so a head trained against
either reads the same values. The layer count L itself (the last layer's output, before the final
norm) is a legal index too: it is taken after the loop.

Every row of the step is kept, not only each sequence's last: a head consumes the hidden states of
every position the target computed (a prompt's, a verify step's accepted rows), and the engine's
verify rows are one-token sequences, so a decode step's T is its verified positions.

Runs before the fusions: rotate_residual then carries x as (x, d) and moves the capture's read of
x onto its true sum x + d, as it does for the layer's first norm.
"""
from ..ir import Node, TensorType, Value


def capture_hidden(state):
    layers = getattr(state, "capture", None)
    if not layers:
        return
    g = state.graph
    loop = next((n for n in g.ordered() if n.op == "layers"), None)
    if loop is None:
        raise state.error("speculation head: the model has no layer loop to capture hidden states from", 1)
    L = loop.attrs["count"]
    bad = [l for l in layers if not isinstance(l, int) or isinstance(l, bool) or not 0 <= l <= L]
    if bad:
        raise state.error(f"speculation head: hidden-state layers {list(layers)} must be layer "
                          f"indices in [0, {L}] (the model has {L} layers)", loop.line)
    bodies = list(loop.bodies.values())
    k = _residual_index(state, loop, g)
    x_type = g.values[loop.inputs[k]].type
    H = x_type.shape[1]
    inner = [l for l in layers if l < L]       # captured in the loop; L after it
    aux_t = TensorType(("T", len(layers) * H), x_type.dtype)

    # before the loop: aux = zeros [T, n*H] (fill_zero of x, side by side n times)
    zero = g.fresh("aux")
    g.add_value(Value(zero, "act", line=loop.line))
    g.add_node(Node(g.new_node_id("fill_zero"), "fill_zero", [loop.inputs[k]], [zero], {}, loop.line),
               before=loop.id)
    aux0 = zero
    for _ in layers[1:]:
        wider = g.fresh("aux")
        g.add_value(Value(wider, "act", line=loop.line))
        g.add_node(Node(g.new_node_id("concat"), "concat", [aux0, zero], [wider], {}, loop.line),
                   before=loop.id)
        aux0 = wider
    for b in bodies:
        aux_in, aux_out = b.fresh("aux"), b.fresh("aux")
        b.add_value(Value(aux_in, "input", aux_t, line=loop.line))
        b.add_value(Value(aux_out, "act", line=loop.line))
        b.add_node(Node(b.new_node_id("capture_hidden"), "capture_hidden", [b.inputs[k], aux_in],
                        [aux_out], {"layers": list(layers), "outside": None}, loop.line),
                   before=b.order[0])
        b.inputs.append(aux_in)
        b.outputs.append(aux_out)
    after = g.fresh("aux")
    g.add_value(Value(after, "act", line=loop.line))
    loop.inputs.append(aux0)
    loop.outputs.append(after)
    g.values[after].producer = loop.id
    out = after
    if len(inner) < len(layers):               # the last layer's output: after the loop
        x_out = loop.outputs[k]
        top = g.fresh("aux")
        g.add_value(Value(top, "act", line=loop.line))
        nxt = g.order[g.order.index(loop.id) + 1] if g.order[-1] != loop.id else None
        g.add_node(Node(g.new_node_id("capture_hidden"), "capture_hidden", [x_out, after], [top],
                        {"layers": list(layers), "outside": L}, loop.line), before=nxt)
        out = top
    # the plan's outputs are float32 (infer_types) and the loop's aux is the model's dtype, one
    # buffer carried in place: the output is a copy of it, converted
    final = g.fresh("aux_hidden")
    g.add_value(Value(final, "act", line=loop.line))
    g.add_node(Node(g.new_node_id("copy"), "copy", [out], [final], {}, loop.line))
    g.outputs.append(final)
    g.output_names.append("aux_hidden")
    state.note("capture_hidden", f"aux_hidden [T, {len(layers)}*{H}]: the residual entering "
                                 f"layers {list(layers)}")


def _residual_index(state, loop, g) -> int:
    """The carried value that is the residual stream: the one [T, H] value the loop carries."""
    ks = [k for k, v in enumerate(loop.inputs)
          if g.values[v].type is not None and len(g.values[v].type.shape) == 2
          and g.values[v].type.shape[0] == "T"]
    if len(ks) != 1:
        raise state.error(f"speculation head: the layer loop carries {len(ks)} [T, H] values; "
                          f"capturing hidden states needs exactly one (the residual stream)", loop.line)
    return ks[0]
