"""The graph IR: values (typed tensors) and op nodes in program order, on a networkx DiGraph.

A `Graph` is one straight-line program. The `layers` node of the top graph holds one nested
Graph per layer kind (a homogeneous model has one kind, "layer"); the plan runs layer i with the
body of kind schedule[i]. Values named in `carried` flow from one layer to the next (the
residual stream); every kind carries the same values.
"""
from dataclasses import dataclass, field

DYNAMIC = ("T", "B")   # tokens in the step, sequences in the step


@dataclass(frozen=True)
class TensorType:
    shape: tuple          # ints, or "T" / "B"
    dtype: str            # bf16 | f32 | i32

    def __str__(self):
        return f"{self.dtype}[{', '.join(str(d) for d in self.shape)}]"


@dataclass
class Value:
    name: str
    kind: str                        # input | weight | act | marker
    type: TensorType | None = None
    producer: str | None = None      # node id
    alias_of: str | None = None      # views and in-place outputs share this value's memory
    alias_offset: int = 0            # element offset of a view's first element inside its row
    line: int | None = None


@dataclass
class Node:
    id: str
    op: str
    inputs: list[str]
    outputs: list[str]
    attrs: dict = field(default_factory=dict)
    line: int | None = None
    bodies: "dict[str, Graph] | None" = None               # layers: kind -> body
    fused_from: list[str] = field(default_factory=list)   # spec ops this node implements
    made_by: str | None = None                            # the pass that created the node


class Graph:
    def __init__(self, name: str, parent: "Graph | None" = None, env: dict | None = None):
        self.name = name
        self.env = env                   # a layer kind's config symbols (its overrides applied)
        # One counter per model, so names are unique across the top graph and layer body.
        self._counter = parent._counter if parent is not None else [0]
        self.output_names: list[str] = []
        self.values: dict[str, Value] = {}
        self.nodes: dict[str, Node] = {}
        self.order: list[str] = []
        self.inputs: list[str] = []      # step inputs or, for a layer body, carried-in values
        self.outputs: list[str] = []
        self.is_body = parent is not None

    @property
    def carried(self) -> dict[str, str]:
        """Layer body: carried output value -> the carried input it feeds next iteration."""
        return dict(zip(self.outputs, self.inputs)) if self.is_body else {}

    # -- construction -------------------------------------------------------------------
    def _tick(self) -> int:
        self._counter[0] += 1
        return self._counter[0]

    def fresh(self, hint: str) -> str:
        return f"{hint.split('.')[0]}.{self._tick()}"

    def add_value(self, v: Value) -> Value:
        assert v.name not in self.values, v.name
        self.values[v.name] = v
        return v

    def add_node(self, node: Node, before: str | None = None) -> Node:
        self.nodes[node.id] = node
        if before is None:
            self.order.append(node.id)
        else:
            self.order.insert(self.order.index(before), node.id)
        for o in node.outputs:
            self.values[o].producer = node.id
        return node

    def new_node_id(self, op: str) -> str:
        return f"{op}#{self._tick()}"

    def remove_node(self, nid: str):
        node = self.nodes.pop(nid)
        self.order.remove(nid)
        for o in node.outputs:
            if self.values.get(o) is not None and self.values[o].producer == nid:
                del self.values[o]

    # -- queries ------------------------------------------------------------------------
    def ordered(self) -> list[Node]:
        return [self.nodes[n] for n in self.order]

    def producer(self, value: str) -> Node | None:
        p = self.values[value].producer
        return self.nodes.get(p) if p else None

    def users(self, value: str) -> list[Node]:
        return [n for n in self.ordered() if value in n.inputs]

    def uses(self, value: str) -> int:
        return sum(n.inputs.count(value) for n in self.ordered()) + self.outputs.count(value)

    def replace_uses(self, old: str, new: str, after: str | None = None):
        start = self.order.index(after) + 1 if after else 0
        for nid in self.order[start:]:
            n = self.nodes[nid]
            n.inputs = [new if i == old else i for i in n.inputs]
        self.outputs = [new if o == old else o for o in self.outputs]

    def to_networkx(self):
        import networkx as nx         # ~0.5 s of import: the runtime's rank workers load ir without it
        g = nx.DiGraph()
        for n in self.ordered():
            g.add_node(n.id, op=n.op)
            for i in n.inputs:
                p = self.values[i].producer
                if p:
                    g.add_edge(p, n.id, value=i)
        return g

    def walk(self):
        """This graph and every nested body, outermost first."""
        yield self
        for n in self.ordered():
            for b in (n.bodies or {}).values():
                yield from b.walk()
