"""Shape and dtype inference: every value gets a TensorType from its op's rule.

Dynamic dims stay symbolic ("T" tokens, "B" sequences). Values a view or in-place op returns
record whose memory they share. The model's outputs (logits) are float32.
"""
from ..ops import REGISTRY, ShapeError
from ..ir import Graph, TensorType


def _infer(state, g: Graph):
    for n in g.ordered():
        if n.op == "layers":
            for body in n.bodies.values():
                for bi, outer in zip(body.inputs, n.inputs):
                    body.values[bi].type = g.values[outer].type
                _infer(state, body)
                for bo, bi in body.carried.items():
                    if body.values[bo].type != body.values[bi].type:
                        # Point at the layer statement that produced the changed value.
                        where = f" (layers(...) at line {n.line} carries it unchanged)" if n.line else ""
                        raise state.error(f"layer changes carried value '{bi}' from "
                                          f"{body.values[bi].type} to {body.values[bo].type}{where}",
                                          body.values[bo].line or n.line)
                for o, bo in zip(n.outputs, body.outputs):
                    g.values[o].type = body.values[bo].type
            continue
        op = REGISTRY[n.op]
        types = [g.values[i].type for i in n.inputs]
        try:
            outs = op.infer(types, n.attrs)
        except ShapeError as e:
            msg = str(e)   # op rules often name themselves already ("view: cannot view ...")
            named = msg.startswith((f"{n.op}:", f"{n.op} "))
            raise state.error(msg if named else f"{n.op}: {msg}", n.line) from None
        if len(outs) != len(n.outputs):       # a variadic op (split): its rule says how many
            raise state.error(f"{n.op} returns {len(outs)} value(s) here but {len(n.outputs)} "
                              f"name(s) are assigned", n.line)
        for k, (o, t) in enumerate(zip(n.outputs, outs)):
            v = g.values[o]
            v.type = t
            if t is None:
                v.kind = "marker"
            if op.view:
                v.alias_of = n.inputs[0]
            if k in op.inplace:
                v.alias_of = n.inputs[op.inplace[k]]


def infer_types(state):
    g = state.graph
    _infer(state, g)
    for o in g.outputs:
        t = g.values[o].type
        g.values[o].type = TensorType(t.shape, "f32")
