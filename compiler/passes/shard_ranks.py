"""Tensor and expert parallelism as a plan transform: rewrite the graph into rank r's share.

Runs after split_attention and before lower_experts and fuse_weights, so that it sees each
checkpoint tensor as its own weight (a shard is one `slice` recipe of one checkpoint tensor,
which a loader reads alone) and attention as kv_write + attention_cached (the caches, whose
layout the ops derive from their input shapes, shrink to the rank's heads by themselves); the
later passes then fuse the shards exactly as they fuse whole weights (q|k|v of rank r is the
concat of rank r's q, k and v slices). Nothing happens at one rank.

Tensor parallelism (Megatron): a linear whose input is computed, through ops that work head by
head or element by element, only from other linears is row-parallel; those linears are
column-parallel. Which ops those are, and how each passes rank r's block (the inputs that carry
it, the inputs every head shares, per-head weights to cut, attributes to resize), is the table in
shard_rules.py: views, per-head norms, rope, concat, head_linear, attention, latent_attention,
activations, mul. Column linears keep a block of output features (whole heads: Hq/N query heads,
Hkv/N kv heads), the row linear the matching block of input features, and an all_reduce after it
sums the ranks' partial outputs (written in fp32 by the row linear, rounded once by the
all_reduce to the activations' dtype): one per sublayer (where two row-parallel branches meet at an add,
their partial sums are added first and reduced once). Every other linear (the router, lm_head)
and the embedding stay replicated, so every rank holds the full residual stream and the full
logits (the sampler needs no gather). Experts under TP keep F/N of each expert's intermediate
features, with an all_reduce after.

Multi-head latent attention (DeepSeek-V2) falls out of the same rules, as vLLM shards it: the
query projections (q_proj, or q_b_proj after the replicated q_a_proj + its norm) are
column-parallel by heads, the absorbed per-head W_uk / W_uv [H, N, K] are cut to the rank's heads,
o_proj is row-parallel. The latent projection kv_a (c_kv + k_pe) and its norm feed every head
(latent_attention's kv input is shared, not walked): they stay replicated, and every rank keeps
the whole latent cache. One kv head (multi-query attention) is kept whole the same way: the
attention walks its query alone, so the kv chain stays replicated and every rank keeps the whole
k / v cache (kv heads more than one and not divisible by the ranks are refused). Per-head sinks
[Hq] are cut to the rank's heads.

DeepSeek-V4 (specs/deepseek_v4.yaml) is MLA's case again: wq_b column-parallel by heads (after the
replicated wq_a + q_norm, which the indexer's query reads too), rope_tail per head, the sinks cut,
the grouped output projection one block of groups a rank (the [T, G, Gk] view, wo_a by group,
wo_b row-parallel, G divisible by the ranks); the shared K = V head, the compressors and the
lightning indexer stay whole on every rank, and with them every cache (swa, the compressed
entries and their partial blocks, the indexer keys): a rank's cache per token is one rank's.

Attention data-parallelism (`dp` in the settings, with EP): attention and dense layers stay
replicated and each rank runs them on its own tokens; the expert block becomes dp_dispatch (every
rank's rows, G = world * T of them) -> the rank's experts -> dp_combine (each rank's rows summed
back), so the experts' launches run over G rows.

Expert parallelism: rank r keeps routed experts r*E/N .. (r+1)*E/N - 1 (a slice of each expert
stack); routing (greedy or group-limited top-k) runs on every rank over the full router logits,
then ep_dispatch sends each token's row to its experts' ranks and ep_combine brings the partial
sums back. Attention and dense MLPs stay replicated unless tensor parallelism shards them too.
DeepSeek's shared experts are a dense SwiGLU in the spec, so they follow the TP rule, as in vLLM
(its DeepseekV2MLP for shared_experts is column/row-parallel over the TP group, with or without
--enable-expert-parallel): sharded F/N under --tensor-parallel-size N, replicated when only the
experts are partitioned (expert_parallel_only).
"""
from ..ir import Node, TensorType, Value
from ..ops.moe import bias_inputs
from .shard_rules import rule


class _Blocked:
    """Where a block's walk stopped (node None: at a value no op computes), and why."""

    def __init__(self, node, why):
        self.node, self.why = node, why


def _region(g, value, nodes: dict, columns: dict, blocked: list):
    """Walk back from `value` to the linears it is computed from, through ops with a sharding
    rule (shard_rules.py); nodes/columns collect the ops in between and those linears, blocked
    the ops that mix the sharded axis (the walk stops there but goes on along other inputs, so
    that an attention further up still makes the block one that must shard)."""
    p = g.producer(value)
    if p is None:
        blocked.append(_Blocked(None, f"'{value}' is not computed by a linear"))
        return
    if p.op == "linear":
        columns[p.id] = p
        return
    if p.id in nodes:
        return
    r = rule(p.op)
    if r is None:
        blocked.append(_Blocked(p, f"{p.op} is not an op the tensor-parallel transform can shard"))
        return
    walked = r.walked(p)
    if r.per_head:
        flat = [g.values[p.inputs[i]].type for i in walked if len(g.values[p.inputs[i]].type.shape) < 3]
        if flat:
            blocked.append(_Blocked(p, f"{p.op} works across the whole feature axis of {flat[0]}, "
                                       f"mixing the heads the ranks split (it shards only head by "
                                       f"head, on [T, heads, D])"))
            return
    for i in r.cut(p):
        if g.values[p.inputs[i]].kind != "weight":
            blocked.append(_Blocked(p, f"{p.op}: its per-head input '{p.inputs[i]}' is not a weight "
                                       f"(only weights are cut to the rank's heads)"))
            return
    nodes[p.id] = p
    for i in walked:
        _region(g, p.inputs[i], nodes, columns, blocked)


def _check_closed(state, g, world, row, nodes, columns):
    """Every value of the block is read only inside it, through an input that carries the block:
    a sharded value that escapes (or feeds an input every head shares) would be read whole."""
    for nid in list(nodes) + list(columns):
        m = g.nodes[nid]
        for o in m.outputs:
            for u in g.users(o):
                at = [i for i, x in enumerate(u.inputs) if x == o]
                carried = [0] if u.id == row.id else rule(u.op).walked(u) if u.id in nodes else []
                if not set(at) <= set(carried):
                    raise state.error(f"--tensor-parallel-size {world}: '{o}' ({m.op}, line {m.line}) "
                                      f"feeds both the sharded block of the linear at line {row.line} "
                                      f"and {u.op} at line {u.line}", u.line)


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
    flag = f"--tensor-parallel-size {world}"
    plans = []
    for n in g.ordered():
        if n.op != "linear":
            continue
        nodes, columns, blocked = {}, {}, []
        _region(g, n.inputs[0], nodes, columns, blocked)
        if blocked:
            # an attention reached, or linears reached past an op that mixes the split axis: a
            # block that must shard and cannot (an attention's heads, e.g. a q norm over all
            # heads at once); else n reads the replicated stream (wq after the layer norm, the
            # router, lm_head, a linear of the residual sum): replicated
            mixing = [b for b in blocked if b.node is not None]
            if any(rule(m.op).attention for m in nodes.values()) or (columns and mixing):
                b = (mixing or blocked)[0]
                where = b.node.line if b.node is not None else n.line
                raise state.error(f"{flag}: cannot shard the block that ends in the linear at line "
                                  f"{n.line} (heads/features split across ranks): {b.why}", where)
            continue                                   # not fed by linears: replicated
        plans.append((n, nodes, columns))
    sharded = {m for _, nodes, _ in plans for m in nodes}
    for m in g.ordered():
        if rule(m.op) is not None and rule(m.op).attention and m.id not in sharded:
            raise state.error(f"{flag}: this {m.op} feeds no row-parallel linear through ops that "
                              f"keep its heads apart, so its heads cannot be split across ranks", m.line)
    rows = {row.id for row, _, _ in plans}
    for row, nodes, columns in plans:
        both = sorted(c.line for c in columns.values() if c.id in rows)
        if both:
            raise state.error(f"{flag}: the linear at line {both[0]} reads one sharded block and "
                              f"feeds another (three linears in a chain); only column -> row pairs "
                              f"are sharded", both[0])
        _check_closed(state, g, world, row, nodes, columns)
    # every block checked before any is rewritten: a rule's walk may read attributes that the
    # resizes change (an attention's kv_heads)
    for row, nodes, columns in plans:
        # heads first: a head count the ranks do not divide is the error to report, not the
        # views or per-head weights around it
        for m in sorted(nodes.values(), key=lambda m: not rule(m.op).attention):
            r = rule(m.op)
            if r.resize:
                r.resize(state, g, m, world)
            for i, axis in r.cut(m).items():
                _shard_weight(state, g, m.inputs[i], axis, rank, world,
                              f"{flag}: the heads of {m.op}'s weight at line {m.line}", m.line)
        for c in columns.values():
            what = f"{flag}: the output features of the linear at line {c.line}"
            _shard_weight(state, g, c.inputs[1], 0, rank, world, what, c.line)
            if c.attrs.get("has_bias"):
                _shard_weight(state, g, c.inputs[2], 0, rank, world, what, c.line)
        what = f"{flag}: the input features of the linear at line {row.line}"
        _shard_weight(state, g, row.inputs[1], 1, rank, world, what, row.line)
        if row.attrs.get("has_bias"):
            _rank0_bias(state, row.inputs[2], rank)
        # the partial sum leaves the GEMM in fp32 and is rounded once, after the ranks' sum:
        # rounding each rank's half to bf16 first made TP=2's logits drift past the golden gate
        # (argmax regret 0.22 nat on 2 x H200 where one GPU gives 0.19)
        dtype = g.values[row.outputs[0]].type.dtype
        row.attrs["out_dtype"] = "f32"
        _insert_after(g, row, "all_reduce", {"dtype": dtype}, "reduced")
        heads = [f"{g.nodes[m].inputs[i]}" for m in nodes for i in rule(g.nodes[m].op).cut(g.nodes[m])]
        state.note("shard_ranks", f"{g.name}: line {row.line} row-parallel over "
                                  f"{sorted(c.inputs[1] for c in columns.values())}"
                                  f"{' and heads of ' + str(sorted(heads)) if heads else ''} + all_reduce")
    for n in [n for n in g.ordered() if n.op == "moe_experts"]:
        if state.parallel["ep"] > 1:
            continue
        x, w, ids, gate, up, down = n.inputs[:6]
        biases = bias_inputs(n.inputs, n.attrs)
        if "down_bias" in biases:        # each rank's partial output would add it again
            raise state.error(f"--tensor-parallel-size {world}: experts with a down-projection bias "
                              f"are not split across ranks yet (--enable-expert-parallel splits "
                              f"whole experts)", n.line)
        what = f"--tensor-parallel-size {world}: the experts' intermediate features"
        _shard_weight(state, g, gate, 1, rank, world, what, n.line)
        _shard_weight(state, g, up, 1, rank, world, what, n.line)
        _shard_weight(state, g, down, 2, rank, world, what, n.line)
        for b in biases.values():        # gate / up biases [E, F]: the rank's features
            _shard_weight(state, g, b, 1, rank, world, what, n.line)
        _insert_after(g, n, "all_reduce", {"dtype": g.values[n.outputs[0]].type.dtype}, "reduced")
        state.note("shard_ranks", f"{g.name}: line {n.line} experts split F/{world} + all_reduce")


def _expert_parallel(state, g, rank, world, data_parallel=False):
    for n in [n for n in g.ordered() if n.op == "moe_experts"]:
        x, w, ids, gate, up, down = n.inputs[:6]
        biases = list(bias_inputs(n.inputs, n.attrs).values())
        E = g.values[gate].type.shape[0]
        if E % world:
            raise state.error(f"--enable-expert-parallel over {world} ranks: {E} experts are not "
                              f"divisible by {world} (each rank holds E/{world} whole routed "
                              f"experts)", n.line)
        for wname in (gate, up, down, *biases):        # [E, ...]: the rank's experts
            _shard_weight(state, g, wname, 0, rank, world, "experts", n.line)
        outs = [g.fresh(h) for h in ("dispatched", "weights", "ids")]
        for o in outs:
            g.add_value(Value(o, "act", line=n.line))
        if data_parallel:
            # each rank holds its own tokens: the experts run over every rank's (G = world * T
            # rows), and each rank gets its rows' sums back
            g.add_node(Node(g.new_node_id("dp_dispatch"), "dp_dispatch", [x, w, ids], outs,
                            {"experts_per_rank": E // world}, n.line, fused_from=[]), before=n.id)
        else:
            # every rank holds every token here (attention tensor-parallel and all-reduced, or
            # replicated): the dispatch selects locally, nothing crosses the wire
            g.add_node(Node(g.new_node_id("ep_dispatch"), "ep_dispatch", [x, w, ids], outs,
                            {"experts_per_rank": E // world, "replicated": True}, n.line, fused_from=[]),
                       before=n.id)
        n.inputs = outs + [gate, up, down] + biases
        _insert_after(g, n, "dp_combine" if data_parallel else "ep_combine", {}, "combined")
        state.note("shard_ranks", f"{g.name}: line {n.line} experts {rank * E // world}.."
                                  f"{(rank + 1) * E // world - 1} of {E} on rank {rank} + dispatch/combine")


def _merge_reductions(state, g):
    """add(all_reduce(a), all_reduce(b)) -> all_reduce(add(a, b)): a sum of partial sums needs one
    collective where two row-parallel branches meet (DeepSeek's shared + routed experts under TP,
    as vLLM reduces them once; a parallel attention + MLP block). The ranks' partial rows are
    added before the reduction instead of after: the same sum, rounded in another order."""
    for n in list(g.ordered()):
        if n.op != "add":
            continue
        ps = [g.producer(i) for i in n.inputs]
        if ps[0] is ps[1] or not all(p is not None and p.op == "all_reduce" and g.uses(p.outputs[0]) == 1
                                     for p in ps):
            continue
        n.inputs = [p.inputs[0] for p in ps]
        dtype = ps[0].attrs["dtype"]          # the reduced sum's (its value is not typed yet)
        for p in ps:
            g.remove_node(p.id)
        _insert_after(g, n, "all_reduce", {"dtype": dtype}, "reduced")
        state.note("shard_ranks", f"{g.name}: line {n.line} one all_reduce after the add of two "
                                  f"partial sums")


def shard_ranks(state):
    par = state.parallel
    if not par or par["world"] == 1:
        return
    rank, world = par["rank"], par["world"]
    for g in state.graph.walk():
        if par["tp"] > 1:
            _tensor_parallel(state, g, rank, world)
            _merge_reductions(state, g)
        if par["ep"] > 1:
            _expert_parallel(state, g, rank, world, data_parallel=par.get("dp", 1) > 1)
