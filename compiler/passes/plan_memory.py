"""Memory planning by liveness: every activation gets an offset in one arena.

Sizes are linear in the step's token count T and sequence count B (bytes = t*T + b*B + c; a
data-parallel plan's G = world * T rows count as T), so
offsets are too; the runtime evaluates them at its max T and B. Views and in-place outputs
share their source's memory; a loop-carried value keeps one buffer across all layers. Slots are
reused first-fit once their last reader has run (B <= T, so a [B, ...] and a [T, ...] value may
share when the coefficients allow).
"""
from ..contract.schema import DTYPE_BYTES
from ..ir import Graph

ALIGN = 256
LARGE_FIXED = 1 << 20       # bytes


def _size(t, world: int = 1) -> tuple[int, int, int]:
    """(bytes per T, per B, fixed). G (a data-parallel plan's rows of every rank: world * T) is
    counted as T rows times the world."""
    coef = {"T": 0, "B": 0, "": 1}
    n, dyn = DTYPE_BYTES[t.dtype], []
    for d in t.shape:
        if isinstance(d, str):
            dyn.append(d)
        else:
            n *= d
    assert len(dyn) <= 1, f"at most one dynamic dim per tensor: {t}"
    key = dyn[0] if dyn else ""
    if key == "G":
        key, n = "T", n * world
    coef[key] = n
    return tuple(-(-coef[k] // ALIGN) * ALIGN for k in ("T", "B", ""))


def _large_fixed(size: tuple) -> bool:
    return size[0] == size[1] == 0 and size[2] >= LARGE_FIXED


class _UF:
    def __init__(self):
        self.p = {}

    def find(self, a):
        self.p.setdefault(a, a)
        while self.p[a] != a:
            self.p[a] = self.p[self.p[a]]
            a = self.p[a]
        return a

    def union(self, a, b):
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.p[rb] = ra


def memory_classes(graph) -> _UF:
    """Values that share one buffer: views and in-place outputs with their sources, and each
    loop-carried value across every layer kind (the layer node's inputs and outputs, each body's
    inputs, outputs and carried pairs)."""
    uf = _UF()
    for g in graph.walk():
        for v in g.values.values():
            if v.alias_of:
                uf.union(v.alias_of, v.name)
        for n in g.ordered():
            if n.op != "layers":
                continue
            for b in n.bodies.values():
                for outer, inner in zip(n.inputs, b.inputs):
                    uf.union(outer, inner)
                for outer, inner in zip(n.outputs, b.outputs):
                    uf.union(inner, outer)
                for bo, bi in b.carried.items():
                    uf.union(bi, bo)
    return uf


def plan_memory(state):
    top = state.graph
    world = (state.parallel or {}).get("world", 1)
    uf = memory_classes(top)
    events = []                         # (index, key, "def"|"use")
    values = {}                         # key -> Value
    clock = [0]

    # a producer merged into its consumer's launch in some phase (merge_prologues) reads its inputs
    # where the consumer runs: they stay live until then, so no output of the consumer (or of a
    # launch between) takes their memory while another program of the merged launch reads them
    merged_into: dict[str, list[str]] = {}
    for merges in state.merges.values():
        for producer, consumer in merges.items():
            merged_into.setdefault(consumer, []).append(producer)
    # a consumer run as its producer's epilogue (merge_epilogues) writes its outputs where the
    # producer runs: what that launch reads (the producer's and its merged prologue's inputs) stays
    # live until the consumer's place, where those outputs are defined
    for phase, tails in state.epilogues.items():
        for producer, consumer in tails.items():
            merged_into.setdefault(consumer, []).extend(
                [producer] + [p for p, c in state.merges.get(phase, {}).items() if c == producer])
    # a LoRA site in its GEMV's launch (merge_lora) writes the expand's output where the linear
    # runs: what that launch reads (the linear's, the shrink's and a merged prologue's inputs)
    # stays live until the expand's place, where the output is defined
    # (a shrink launched apart, state.lora_apart, runs at its own place: its output is live from
    # there to the expand's; only the nodes in between, views, run between it and the GEMV)
    for phase, sites in state.lora_sites.items():
        for lin, (shrink, expand) in sites.items():
            merged_into.setdefault(expand, []).extend(
                [lin] + ([] if phase in state.lora_apart else [shrink])
                + [p for p, c in state.merges.get(phase, {}).items() if c == lin])

    def visit(g: Graph):
        for v in g.values.values():
            if v.kind in ("act", "input") and v.type is not None:
                if sum(isinstance(d, str) for d in v.type.shape) > 1:
                    raise state.error(f"'{v.name.split('.')[0]}' has shape {v.type}: a value may have "
                                      f"at most one dynamic dimension (T, B or G)", v.line)
                values[v.name] = v        # names are unique across the model's graphs
        for n in g.ordered():
            clock[0] += 1
            if n.op == "layers":
                for i in n.inputs:
                    events.append((clock[0], i, "use"))
                # Kinds run one layer at a time, so their bodies take turns on the timeline:
                # a body's own values may share slots with another kind's; carried values are
                # one buffer across every kind (memory_classes).
                for b in n.bodies.values():
                    visit(b)
                clock[0] += 1
                for o in n.outputs:
                    events.append((clock[0], o, "def"))
                continue
            for i in n.inputs:
                events.append((clock[0], i, "use"))
            for p in merged_into.get(n.id, []):
                for i in g.nodes[p].inputs:
                    events.append((clock[0], i, "use"))
            for o in n.outputs:
                events.append((clock[0], o, "def"))

    for i in top.inputs:
        events.append((0, i, "def"))
    visit(top)
    end = clock[0] + 1
    # the model's outputs, and what the runtime re-reads after the program (passes/row_logits.py)
    for o in top.outputs + (state.row_logits or {}).get("inputs", []):
        events.append((end, o, "use"))

    live: dict[str, list[int]] = {}
    for t, k, _ in events:
        if k not in values:
            continue
        r = uf.find(k)
        iv = live.setdefault(r, [t, t])
        iv[0], iv[1] = min(iv[0], t), max(iv[1], t)
    for i in top.inputs:                # step inputs stay put for the whole step
        live[uf.find(i)][1] = end

    # size of a class: its largest member (views are never larger than their source)
    size: dict[str, tuple] = {}
    for k, v in values.items():
        r = uf.find(k)
        s = _size(v.type, world)
        size[r] = tuple(max(a, b) for a, b in zip(size.get(r, (0, 0, 0)), s))

    slots = []                          # [size, free_at]
    slot_of = {}
    for r in sorted(live, key=lambda r: (live[r][0], r)):
        start, stop = live[r]
        need = size[r]
        best = None
        # a large value of fixed size (an upcast expert stack: passes/upcast_experts.py) and the
        # others keep to slots of their own sort: in a slot sized by T its bytes would add to the
        # T buffers' at every step size, and a T buffer in its slot would leave the next layer
        # kind's stack none to reuse
        fixed = _large_fixed(need)
        for i, (ssize, free_at) in enumerate(slots):
            if free_at < start and fixed == _large_fixed(ssize):
                grow = sum(max(0, a - b) for a, b in zip(need, ssize))
                waste = sum(max(0, b - a) for a, b in zip(need, ssize))
                cand = (grow, waste, i)
                best = cand if best is None or cand < best else best
        if best is None:
            slots.append([need, stop])
            slot_of[r] = len(slots) - 1
        else:
            i = best[2]
            slots[i] = [tuple(max(a, b) for a, b in zip(need, slots[i][0])), stop]
            slot_of[r] = i
    offsets, acc = [], (0, 0, 0)
    for s, _ in slots:
        offsets.append(acc)
        acc = tuple(a + b for a, b in zip(acc, s))
    state.memory = {
        "root": {k: uf.find(k) for k in values},
        "slot_of": slot_of,
        "slot_offsets": offsets,
        "slot_sizes": [s for s, _ in slots],
        "arena": acc,
        "live": live,
        "values": values,
    }
    naive = tuple(sum(_size(v.type, world)[i] for k, v in values.items() if uf.find(k) == k) for i in range(3))
    state.note("plan_memory", f"{len(live)} buffers in {len(slots)} slots; arena bytes = "
                              f"{acc[0]}*T + {acc[1]}*B + {acc[2]} (unshared: {naive[0]}*T + {naive[1]}*B + {naive[2]})")
