"""Carry each layer's last residual add into the next layer, so it can fuse with that layer's
first RMSNorm (and the final norm): the loop carries (x, d) with x + d the true residual.

    before:  x = layers(x)  with body  [... x = add(x, y)]
    after:   d = fill_zero(x); x, d = layers(x, d)  with body  [x = add(x, d); ...; d = y]
             x = add(x, d) after the loop

With several layer kinds, every kind's body must end in such an add, or none is rotated.
"""
from ..ir import Node, Value


def _rotatable(body, k: int, out: str, cin: str) -> bool:
    last = body.producer(out)
    return last is not None and last.op == "add" and last.inputs[0] != cin and body.uses(out) == 1


def _rotate_body(body, k: int, line):
    out, cin = body.outputs[k], body.inputs[k]
    last = body.producer(out)
    resid, delta = last.inputs
    d_in = "d"
    body.add_value(Value(d_in, "input", line=line))
    body.inputs.append(d_in)
    x0 = body.fresh(cin)
    body.add_value(Value(x0, "act", line=last.line))
    first = body.order[0]
    body.replace_uses(cin, x0)
    body.add_node(Node(body.new_node_id("add"), "add", [cin, d_in], [x0], {}, last.line,
                       fused_from=["add"]), before=first)
    body.remove_node(last.id)
    body.outputs[k] = resid
    body.outputs.append(delta)


def rotate_residual(state):
    g = state.graph
    for n in list(g.ordered()):
        if n.op != "layers":
            continue
        bodies = list(n.bodies.values())
        for k, cin in enumerate(list(bodies[0].inputs)):
            if not all(_rotatable(b, k, b.outputs[k], cin) for b in bodies):
                continue
            for b in bodies:
                _rotate_body(b, k, n.line)
            # top: zero delta before the loop, the pending add after it
            x_before = n.inputs[k]
            d0 = g.fresh("d")
            g.add_value(Value(d0, "act", line=n.line))
            g.add_node(Node(g.new_node_id("fill_zero"), "fill_zero", [x_before], [d0], {}, n.line),
                       before=n.id)
            n.inputs.append(d0)
            d_out = g.fresh("d")
            g.add_value(Value(d_out, "act", line=n.line))
            n.outputs.append(d_out)
            g.values[d_out].producer = n.id
            x_out = n.outputs[k]
            x_sum = g.fresh(x_out)
            g.add_value(Value(x_sum, "act", line=n.line))
            g.replace_uses(x_out, x_sum)
            nxt = g.order[g.order.index(n.id) + 1] if g.order[-1] != n.id else None
            g.add_node(Node(g.new_node_id("add"), "add", [x_out, d_out], [x_sum], {}, n.line,
                            fused_from=["add"]), before=nxt)
            state.note("rotate_residual", f"carry '{cin}' with pending delta "
                                          f"'{bodies[0].outputs[-1]}' -> 'd'")
            return
