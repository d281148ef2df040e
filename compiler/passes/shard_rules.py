"""How each op passes rank r's block of heads through a tensor-parallel region (shard_ranks.py).

Between the column-parallel linears and the row-parallel linear of a block, rank r holds a block
of the split axis: the feature axis of a 2-D [T, N] activation, or the heads axis 1 of a 3-D
[T, heads, D] one (a view between the two keeps the split: rank r's features are its heads' rows).
An op may sit inside such a block only if it has a rule here, which says, for that op:

  walk       the inputs that carry the block (computed, through more ops of the block, from the
             column linears); None: every input; or a function of the node, where its attributes
             decide (an attention with one kv head walks its query alone)
  per_head   the op works along the last axis (a norm, a rotation, a concatenation): its walked
             inputs must be [T, heads, D], so that the last axis lies within one head
  weights    {input: axis}: weights indexed by head (MLA's absorbed W_uk / W_uv, [H, N, K], the
             attention sinks [H]), cut to the rank's heads along that axis; or a function of the
             node (an optional input's index)
  attention  the op attends head by head: a block that reaches it must shard (an error otherwise,
             never a silent replication), and the ranks must divide its query heads
  resize     rewrites the op's attributes for the rank's share (a view's shape, kv_heads)

Inputs a rule neither walks nor cuts are shared by every head and stay whole on every rank: a
norm's weight, the latent row [c_kv | k_pe] of multi-head latent attention (one kv "head" that
every query head reads, so each rank keeps the whole latent cache, as vLLM does for MLA under
TP), the one kv head of multi-query attention (DeepSeek-V4's shared K = V head, Gemma-2b's:
each rank keeps the whole kv cache, as vLLM replicates kv heads it cannot split), and
DeepSeek-V4's compressed entries and indexer top-k (the table says why). An op without a rule
mixes the split axis (a norm over all heads at once, a split of a 2-D row), and the transform
refuses to shard through it.
"""
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Rule:
    walk: tuple | None = None
    per_head: bool = False
    weights: dict = field(default_factory=dict)
    attention: bool = False
    resize: object = None            # (state, g, node, world) -> None; raises state.error

    def walked(self, node) -> list[int]:
        walk = self.walk(node) if callable(self.walk) else self.walk
        return list(range(len(node.inputs))) if walk is None else list(walk)

    def cut(self, node) -> dict:
        """{input: axis} of the node's per-head weights."""
        return dict(self.weights(node) if callable(self.weights) else self.weights)


def _flag(world):
    return f"--tensor-parallel-size {world}"


def _query_heads(state, g, m, world):
    hq = g.values[m.inputs[0]].type.shape[1]
    if hq % world:
        raise state.error(f"{_flag(world)} does not divide the {hq} query heads of this "
                          f"{m.op.replace('_cached', '').replace('_', ' ')}", m.line)


def _resize_attention(state, g, m, world):
    if m.attrs.get("alibi") is not None:   # the slopes follow the global head index
        raise state.error(f"{_flag(world)}: ALiBi attention is not split across ranks yet "
                          f"(run this model on one rank)", m.line)
    _query_heads(state, g, m, world)
    hkv = m.attrs["kv_heads"]
    if hkv == 1:                     # the one kv head stays whole on every rank (_attention_walk)
        return
    if hkv % world:
        raise state.error(f"{_flag(world)} does not divide the {hkv} kv heads of this attention "
                          f"(replicating kv heads across ranks is not supported)", m.line)
    m.attrs["kv_heads"] = hkv // world


def _resize_view(state, g, m, world):
    shape = list(m.attrs["shape"])
    rows_in = g.values[m.inputs[0]].type.shape[0]
    if len(shape) < 2 or shape[0] != rows_in or not isinstance(shape[1], int) or shape[1] % world:
        raise state.error(f"{_flag(world)}: cannot split view {shape} into {world} blocks of "
                          f"its axis 1", m.line)
    shape[1] //= world
    m.attrs["shape"] = shape


def _attention_walk(m):
    """q and the cache marker (k / v through kv_write); with one kv head, q alone: every query
    head reads that head, so its chain (DeepSeek-V4's 2-D rms_norm(linear(h, wkv)), a [T, 1, D]
    view no rank count divides) stays whole on every rank, as MLA's latent row does."""
    return (0,) if m.attrs["kv_heads"] == 1 else (0, 1)


def _sinks(m):
    """The per-head sinks [Hq] (input 2, where the spec gives them): the rank's heads."""
    return {2: 0} if m.attrs.get("has_sinks") else {}


_ELEMENTWISE = Rule()                                   # every input carries the same block
_OVER_LAST_AXIS = Rule(walk=(0,), per_head=True)        # x carries it; a weight over D is shared

RULES = {
    "view": Rule(walk=(0,), resize=_resize_view),
    "mul": _ELEMENTWISE, "add": _ELEMENTWISE, "affine": _ELEMENTWISE, "softcap": _ELEMENTWISE,
    "copy": _ELEMENTWISE, "clamp": _ELEMENTWISE, "threshold": _ELEMENTWISE,
    # xIELU: x carries the block; its two trained scalars are shared
    "xielu": Rule(walk=(0,)),
    "normalize": _OVER_LAST_AXIS,
    "rms_norm": _OVER_LAST_AXIS, "layer_norm": _OVER_LAST_AXIS, "rope": _OVER_LAST_AXIS,
    "rope_tail": _OVER_LAST_AXIS,                       # DeepSeek-V4: per head, its last R dims
    "l2_norm": _OVER_LAST_AXIS,                         # per head (Llama-4's weightless q/k norm)
    # joins its inputs along the last axis: head h of the result is head h of each input
    "concat": Rule(per_head=True),
    # y[t, h] = w[h] @ x[t, h]: the rank's heads of x with the rank's heads of w
    "head_linear": Rule(walk=(0,), per_head=True, weights={1: 0}),
    # standard attention after split_attention: q, and k / v through the cache write
    "kv_write": _ELEMENTWISE,
    "attention_cached": Rule(walk=_attention_walk, weights=_sinks, attention=True, resize=_resize_attention),
    # MLA: the query's heads split; the latent row kv (input 1) is shared by every head
    "latent_attention": Rule(walk=(0,), attention=True, resize=_query_heads),
    # DeepSeek-V4 (after split_compression): the query's heads split, with their sinks (input 2);
    # the shared K = V head kv [T, D] and the compressor's rows and weights (compress_write, so the
    # compressed caches) and the indexer's top-k are shared by every head and stay whole on every
    # rank: compress_write and indexer_topk_cached have no rule, their inputs never come from a
    # column linear.
    # indexer_topk_cached has no rule on purpose: it stays replicated (its inputs come from the
    # replicated stream, never from a column linear). Its Hi heads could split, but they score
    # ONE key a compressed entry (the indexer cache is shared by all of them, so every rank would
    # still read all of it) and their scores are summed before the top-k: a split needs an
    # all_reduce of the [T, entries] scores (at 128k and a prefill step of 8192 tokens, 32k
    # entries x 8192 rows x 4 B = 1 GiB a layer) to save a 1/N share of a q . K product whose
    # keys are read anyway; replicated, it costs each rank its ~21 MB of indexer weights a layer.
    "compressed_attention_cached": Rule(walk=(0,), weights={2: 0}, attention=True, resize=_query_heads),
}


def rule(op: str) -> Rule | None:
    if op in RULES:
        return RULES[op]
    from ..ops.activation import ACTIVATIONS
    return _ELEMENTWISE if op in ACTIVATIONS else None
