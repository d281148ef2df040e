"""Tensor and expert parallelism as a plan transform: rewrite the graph into rank r's share.

Runs after split_attention and before lower_experts and fuse_weights, so that it sees each
checkpoint tensor as its own weight (a shard is one `slice` recipe of one checkpoint tensor,
which a loader reads alone) and attention as kv_write + attention_cached (the caches, whose
layout the ops derive from their input shapes, shrink to the rank's heads by themselves); the
later passes then fuse the shards exactly as they fuse whole weights (q|k|v of rank r is the
concat of rank r's q, k and v slices). Nothing happens at one rank.

Tensor parallelism (Megatron): a linear whose input is computed, through ops that work head by
head or element by element (view, per-head norm, rope, attention, activations, mul), only from
other linears is row-parallel; those linears are column-parallel. Column linears keep a block
of output features (whole heads: Hq/N query heads, Hkv/N kv heads), the row linear the matching
block of input features, and an all_reduce after it sums the ranks' partial outputs: one per
sublayer. Every other linear (the router, lm_head) and the embedding stay replicated, so every
rank holds the full residual stream and the full logits (the sampler needs no gather).
Experts under TP keep F/N of each expert's intermediate features, with an all_reduce after.

Expert parallelism: rank r keeps experts r*E/N .. (r+1)*E/N - 1 (a slice of each expert stack);
ep_dispatch sends each token's row to its experts' ranks and ep_combine brings the partial
sums back. Attention and dense MLPs stay replicated unless tensor parallelism shards them too.
"""
from ..ir import Node, TensorType, Value
from ..ops import REGISTRY

# ops a column-parallel block passes through: they work per head (the last axis stays whole)
# or per element, so rank r's block of heads/features maps to the same block of the output
PER_HEAD = {"rms_norm", "layer_norm", "rope"}          # over the last axis: need [T, heads, D]
ELEMENTWISE = {"view", "mul", "add", "affine", "softcap", "copy", "kv_write", "attention_cached"}


def _elementwise_ops():
    from ..ops.activation import ACTIVATIONS
    return ELEMENTWISE | set(ACTIVATIONS)


class _Blocked(Exception):
    def __init__(self, node, why):
        super().__init__(why)
        self.node, self.why = node, why


def _region(g, value, ops, nodes: dict, columns: dict):
    """Walk back from `value` to the linears it is computed from; nodes/columns collect the
    ops in between and those linears. Raises _Blocked at an op that mixes the sharded axis."""
    p = g.producer(value)
    if p is None:
        raise _Blocked(None, f"'{value}' is not computed by a linear")
    if p.op == "linear":
        columns[p.id] = p
        return
    if p.id in nodes:
        return
    if p.op in PER_HEAD:
        if len(g.values[p.inputs[0]].type.shape) < 3:
            raise _Blocked(p, f"{p.op} works across the whole feature axis of "
                              f"{g.values[p.inputs[0]].type}, mixing the heads the ranks split "
                              f"(it shards only head by head, on [T, heads, D])")
        nodes[p.id] = p
        _region(g, p.inputs[0], ops, nodes, columns)
        return
    if p.op not in ops:
        raise _Blocked(p, f"{p.op} is not an op the tensor-parallel transform can shard")
    nodes[p.id] = p
    for i in p.inputs:
        _region(g, i, ops, nodes, columns)


def _shard_weight(state, g, name, axis, rank, world, what, line):
    """Replace weight `name` in g by its rank-r slice along `axis` (a load-time recipe). A weight
    several layer kinds share is sliced once; the other bodies take the new type."""
    v = g.values[name]
    done = state.parallel.setdefault("sharded", {})
    if name in done:
        if done[name][0] != axis:
            raise state.error(f"{what}: weight '{name}' is shared by layer kinds that shard it "
                              f"differently", line)
        v.type = done[name][1]
        return
    if "tied" in state.weights[name]["source"]:
        raise state.error(f"{what}: weight '{name}' is tied to '{state.weights[name]['source']['tied']}', "
                          f"which stays whole; sharding a tied weight is not supported", line)
    n = v.type.shape[axis]
    if n % world:
        raise state.error(f"{what}: {n} is not divisible by {world} ranks "
                          f"(weight '{name}' {v.type})", line)
    k = n // world
    meta = state.weights[name]
    shape = list(v.type.shape)
    shape[axis] = k
    t = TensorType(tuple(shape), v.type.dtype)
    v.type = t
    meta["source"] = {"slice": meta["source"], "axis": axis, "start": rank * k, "stop": (rank + 1) * k}
    meta["type"] = t
    done[name] = (axis, t)


def _rank0_bias(state, name, rank):
    """The bias of a row-parallel linear is added once, by rank 0, before the all_reduce. The
    other ranks keep the same launch (same kernel on every rank) with the bias times 0: a recipe
    of the checkpoint tensor, so the checkpoint check still sees it read."""
    meta = state.weights[name]
    if rank and not (meta["source"].get("by") == 0.0 and "scale" in meta["source"]):
        meta["source"] = {"scale": meta["source"], "by": 0.0}


def _insert_after(g, node, op, attrs, hint):
    """out = op(node's outputs...) right after node; later uses read out instead."""
    outs = []
    for o in node.outputs:
        new = g.fresh(hint)
        g.add_value(Value(new, "act", line=node.line))
        outs.append(new)
    nxt = g.order[g.order.index(node.id) + 1] if g.order.index(node.id) + 1 < len(g.order) else None
    for o, new in zip(node.outputs, outs):
        g.replace_uses(o, new, after=node.id)
    c = Node(g.new_node_id(op), op, list(node.outputs), outs, attrs, node.line, fused_from=[])
    g.add_node(c, before=nxt)
    return c


def _tensor_parallel(state, g, rank, world):
    ops = _elementwise_ops()
    plans = []
    for n in g.ordered():
        if n.op != "linear":
            continue
        nodes, columns = {}, {}
        try:
            _region(g, n.inputs[0], ops, nodes, columns)
        except _Blocked as b:
            # blocked after reaching a linear or an attention: a block that must shard and cannot
            # (an attention's heads, e.g. a q norm over all heads at once); else n reads the
            # replicated stream (wq after the layer norm, the router, lm_head): replicated
            if columns or any(m.op == "attention_cached" for m in nodes.values()):
                where = b.node.line if b.node is not None else n.line
                raise state.error(f"--tensor-parallel-size {world}: cannot shard the block that ends in "
                                  f"the linear at line {n.line} (heads/features split across ranks): "
                                  f"{b.why}", where) from None
            continue                                   # not fed by linears: replicated
        plans.append((n, nodes, columns))
    rows = {row.id for row, _, _ in plans}
    for row, nodes, columns in plans:
        both = sorted(c.line for c in columns.values() if c.id in rows)
        if both:
            raise state.error(f"--tensor-parallel-size {world}: the linear at line {both[0]} reads one "
                              f"sharded block and feeds another (three linears in a chain); only "
                              f"column -> row pairs are sharded", both[0])
        inside = set(nodes) | set(columns) | {row.id}
        for nid in list(nodes) + list(columns):
            m = g.nodes[nid]
            for o in m.outputs:
                for u in g.users(o):
                    if u.id not in inside:
                        raise state.error(f"--tensor-parallel-size {world}: '{o}' ({m.op}, line {m.line}) "
                                          f"feeds both the sharded block of the linear at line {row.line} "
                                          f"and {u.op} at line {u.line}", u.line)
        # heads first: a head count the ranks do not divide is the error to report, not the
        # views around it
        for m in sorted(nodes.values(), key=lambda m: m.op != "attention_cached"):
            if m.op == "attention_cached":
                hq, hkv = g.values[m.inputs[0]].type.shape[1], m.attrs["kv_heads"]
                if hq % world:
                    raise state.error(f"--tensor-parallel-size {world} does not divide the {hq} query "
                                      f"heads of this attention", m.line)
                if hkv % world:
                    raise state.error(f"--tensor-parallel-size {world} does not divide the {hkv} kv heads "
                                      f"of this attention (replicating kv heads across ranks is not "
                                      f"supported)", m.line)
                m.attrs["kv_heads"] = hkv // world
            elif m.op == "view":
                shape = list(m.attrs["shape"])
                rows_in = g.values[m.inputs[0]].type.shape[0]
                if len(shape) < 2 or shape[0] != rows_in or not isinstance(shape[1], int) \
                        or shape[1] % world:
                    raise state.error(f"--tensor-parallel-size {world}: cannot split view {shape} into "
                                      f"{world} blocks of its axis 1", m.line)
                shape[1] //= world
                m.attrs["shape"] = shape
        for c in columns.values():
            what = f"--tensor-parallel-size {world}: the output features of the linear at line {c.line}"
            _shard_weight(state, g, c.inputs[1], 0, rank, world, what, c.line)
            if c.attrs.get("has_bias"):
                _shard_weight(state, g, c.inputs[2], 0, rank, world, what, c.line)
        what = f"--tensor-parallel-size {world}: the input features of the linear at line {row.line}"
        _shard_weight(state, g, row.inputs[1], 1, rank, world, what, row.line)
        if row.attrs.get("has_bias"):
            _rank0_bias(state, row.inputs[2], rank)
        _insert_after(g, row, "all_reduce", {}, "reduced")
        state.note("shard_ranks", f"{g.name}: line {row.line} row-parallel over "
                                  f"{sorted(c.inputs[1] for c in columns.values())} + all_reduce")
    for n in [n for n in g.ordered() if n.op == "moe_experts"]:
        if state.parallel["ep"] > 1:
            continue
        x, w, ids, gate, up, down = n.inputs
        what = f"--tensor-parallel-size {world}: the experts' intermediate features"
        _shard_weight(state, g, gate, 1, rank, world, what, n.line)
        _shard_weight(state, g, up, 1, rank, world, what, n.line)
        _shard_weight(state, g, down, 2, rank, world, what, n.line)
        _insert_after(g, n, "all_reduce", {}, "reduced")
        state.note("shard_ranks", f"{g.name}: line {n.line} experts split F/{world} + all_reduce")


def _expert_parallel(state, g, rank, world):
    for n in [n for n in g.ordered() if n.op == "moe_experts"]:
        x, w, ids, gate, up, down = n.inputs
        E = g.values[gate].type.shape[0]
        if E % world:
            raise state.error(f"--enable-expert-parallel over {world} ranks: {E} experts are not "
                              f"divisible by {world}", n.line)
        for wname in (gate, up, down):
            _shard_weight(state, g, wname, 0, rank, world, "experts", n.line)
        outs = [g.fresh(h) for h in ("dispatched", "weights", "ids")]
        for o in outs:
            g.add_value(Value(o, "act", line=n.line))
        g.add_node(Node(g.new_node_id("ep_dispatch"), "ep_dispatch", [x, w, ids], outs,
                        {"experts_per_rank": E // world}, n.line, fused_from=[]), before=n.id)
        n.inputs = outs + [gate, up, down]
        _insert_after(g, n, "ep_combine", {}, "combined")
        state.note("shard_ranks", f"{g.name}: line {n.line} experts {rank * E // world}.."
                                  f"{(rank + 1) * E // world - 1} of {E} on rank {rank} + dispatch/combine")


def shard_ranks(state):
    par = state.parallel
    if not par or par["world"] == 1:
        return
    rank, world = par["rank"], par["world"]
    for g in state.graph.walk():
        if par["tp"] > 1:
            _tensor_parallel(state, g, rank, world)
        if par["ep"] > 1:
            _expert_parallel(state, g, rank, world)
