"""How each op passes rank r's block of heads through a tensor-parallel region (shard_ranks.py).

Between the column-parallel linears and the row-parallel linear of a block, rank r holds a block
of the split axis: the feature axis of a 2-D [T, N] activation, or the heads axis 1 of a 3-D
[T, heads, D] one (a view between the two keeps the split: rank r's features are its heads' rows).
An op may sit inside such a block only if it has a rule here, which says, for that op:

  walk       the inputs that carry the block (computed, through more ops of the block, from the
             column linears); None: every input
  per_head   the op works along the last axis (a norm, a rotation, a concatenation): its walked
             inputs must be [T, heads, D], so that the last axis lies within one head
  weights    {input: axis}: weights indexed by head (MLA's absorbed W_uk / W_uv, [H, N, K]), cut to
             the rank's heads along that axis
  attention  the op attends head by head: a block that reaches it must shard (an error otherwise,
             never a silent replication), and the ranks must divide its query heads
  resize     rewrites the op's attributes for the rank's share (a view's shape, kv_heads)

Inputs a rule neither walks nor cuts are shared by every head and stay whole on every rank: a
norm's weight, the latent row [c_kv | k_pe] of multi-head latent attention (one kv "head" that
every query head reads, so each rank keeps the whole latent cache, as vLLM does for MLA under
TP). An op without a rule mixes the split axis (a norm over all heads at once, a split of a 2-D
row), and the transform refuses to shard through it.
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
        return list(range(len(node.inputs))) if self.walk is None else list(self.walk)


def _flag(world):
    return f"--tensor-parallel-size {world}"


def _query_heads(state, g, m, world):
    hq = g.values[m.inputs[0]].type.shape[1]
    if hq % world:
        raise state.error(f"{_flag(world)} does not divide the {hq} query heads of this "
                          f"{m.op.replace('_cached', '').replace('_', ' ')}", m.line)


def _resize_attention(state, g, m, world):
    if m.attrs.get("has_sinks"):     # the per-head sinks would need the rank's slice of heads
        raise state.error(f"{_flag(world)}: attention sinks are not split across ranks yet "
                          f"(run this model on one rank)", m.line)
    if m.attrs.get("alibi") is not None:   # the slopes follow the global head index
        raise state.error(f"{_flag(world)}: ALiBi attention is not split across ranks yet "
                          f"(run this model on one rank)", m.line)
    _query_heads(state, g, m, world)
    hkv = m.attrs["kv_heads"]
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
    "l2_norm": _OVER_LAST_AXIS,                         # per head (Llama-4's weightless q/k norm)
    # joins its inputs along the last axis: head h of the result is head h of each input
    "concat": Rule(per_head=True),
    # y[t, h] = w[h] @ x[t, h]: the rank's heads of x with the rank's heads of w
    "head_linear": Rule(walk=(0,), per_head=True, weights={1: 0}),
    # standard attention after split_attention: q, and k / v through the cache write
    "kv_write": _ELEMENTWISE,
    "attention_cached": Rule(attention=True, resize=_resize_attention),
    # MLA: the query's heads split; the latent row kv (input 1) is shared by every head
    "latent_attention": Rule(walk=(0,), attention=True, resize=_query_heads),
}


def rule(op: str) -> Rule | None:
    if op in RULES:
        return RULES[op]
    from ..ops.activation import ACTIVATIONS
    return _ELEMENTWISE if op in ACTIVATIONS else None
