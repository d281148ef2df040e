"""Make strided views contiguous where a kernel needs it.

A `split` of a fused linear's output gives column slices of a wider buffer (row-strided views).
Fusion passes consume most of them; whatever is left feeds generic kernels. An op whose home
declares `strided=True` reads the row stride itself; before any other op a `copy` is inserted,
so every graph the spec language accepts builds (`infc inspect` shows the copies).
"""
from ..ir import Graph, Node, Value
from ..ops import REGISTRY


def is_strided(g: Graph, name: str) -> bool:
    cur = name
    while g.values[cur].alias_of is not None:
        p = g.producer(cur)
        if p is not None and p.op == "split" and len(p.attrs["sizes"]) > 1:
            return True
        cur = g.values[cur].alias_of
    return False


def materialize_views(state):
    for g in state.graph.walk():
        copies: dict[str, str] = {}
        for n in list(g.ordered()):
            if n.op in ("layers", "copy") or REGISTRY[n.op].view or REGISTRY[n.op].strided:
                continue
            for k, x in enumerate(n.inputs):
                v = g.values.get(x)
                if v is None or v.kind not in ("act", "input") or v.type is None or not is_strided(g, x):
                    continue
                if x not in copies:
                    c = g.fresh(x.split(".")[0] + "_c")
                    g.add_value(Value(c, "act", line=n.line))
                    g.add_node(Node(g.new_node_id("copy"), "copy", [x], [c], {}, n.line,
                                    fused_from=["copy"]), before=n.id)
                    copies[x] = c
                    state.note("materialize_views", f"{g.name}: copy {x} before {n.op} (line {n.line})")
                n.inputs[k] = copies[x]
