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
        except (TypeError, ValueError, AttributeError, LookupError, ArithmeticError) as e:
            # A rule comparing or computing with an attribute of the wrong kind (a spec's
            # `rope(q, 'x')`, `attention(..., scale='a')`): say which statement and values.
            raise state.error(f"{n.op}: an attribute has the wrong type or value ({e}); its "
                              f"attributes: {_shown_attrs(n.attrs)}", n.line) from None
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


def _shown_attrs(attrs: dict) -> str:
    text = ", ".join(f"{k}={v!r}" for k, v in attrs.items())
    return text if len(text) <= 300 else text[:297] + "..."


def _check_logits(state, g: Graph):
    """The runtime samples each sequence's next token from its row of logits [B, V]: logits of
    the T token rows (no last(...)) or of another rank would be sampled from the wrong rows."""
    if "logits" not in g.output_names:
        return
    name = g.outputs[g.output_names.index("logits")]
    t = g.values[name].type
    if t is None or len(t.shape) != 2 or t.shape[0] != "B" or isinstance(t.shape[1], str):
        raise state.error(f"logits must be one row per sequence, [B, vocab] (take each sequence's "
                          f"last token with last(x) before the vocabulary projection), got {t}",
                          g.values[name].line or _producer_line(g, name))


def _producer_line(g: Graph, name: str):
    n = g.producer(name)
    return n.line if n is not None else None


def infer_types(state):
    g = state.graph
    _infer(state, g)
    _check_logits(state, g)
    for o in g.outputs:
        t = g.values[o].type
        g.values[o].type = TensorType(t.shape, "f32")
