"""Collectives: the ops that move data between ranks (tensor and expert parallelism).

The parallel transform (compiler/passes/shard_ranks.py) inserts them; specs never write them.
Their numpy references simulate the ranks: the simulated-rank executor
(runtime/reference/ranks.py) runs every rank's plan launch by launch and, for a collective
launch, hands each rank's reference `ctx.exchange`, whose `inputs(i)` is the list of every
rank's i-th input of this launch (rank order). A single-rank context (ctx.world == 1, no
exchange) makes every collective the identity, so a rank plan also runs alone.

all_reduce(x, dtype) -> sum over ranks of x, summed in rank order (the same bits on every rank),
    in `dtype` (default x's): the row-parallel linears write their partials in fp32 and the
    all_reduce rounds the sum once to the activations' dtype
all_gather(x, axis) -> the ranks' x concatenated along `axis` in rank order
ep_dispatch(x[T, H], weights[T, k], ids[T, k], experts_per_rank)
    -> (xr[T, H], wr f32[T, k], idr i32[T, k]): the rows of the tokens that chose one of this
    rank's experts (rank r owns experts r*E/N .. (r+1)*E/N - 1), sent by the token's owner rank
    (token t is owned by rank t % N: each row crosses the wire once); slots whose expert lives
    on another rank get weight 0 and id -1 (no expert: the rank computes only its own experts'
    rows), and a token none of whose experts are local gets a zero row, weight 0 and local id 0
    in slot 0 (so that expert 0 writes its output row: zeros), -1 in the others.
    `replicated`: every rank already holds every token's row, the same bits (tensor parallelism
    all-reduces the residual stream; expert parallelism alone replicates attention): the owner's
    row is this rank's own, so nothing crosses the wire (the reference checks that the ranks'
    rows agree). Every parallel mode built so far replicates the tokens; attention
    data-parallelism (issue 14) would not.
ep_combine(y[T, H]) -> [T, H]: each rank's partial expert sums go back to the tokens' owner
    ranks, which add them (rank order), and the owners' rows are shared with every rank again
    (attention is replicated, so every rank needs every token): a reduce-scatter by owner
    followed by an all-gather.
dp_dispatch(x[T, H], weights[T, k], ids[T, k], experts_per_rank)
    -> (xg[G, H], wg f32[G, k], idg i32[G, k]), G = world * T: attention data-parallelism, where
    each rank runs attention over its own sequences (T tokens, the same T on every rank: the
    runtime pads the ranks' steps to the longest) and the experts over every rank's tokens.
    Row r * T + t is rank r's token t (an all-gather, rank order), masked to this rank's experts
    as ep_dispatch masks them (weight 0 / id -1 elsewhere; a token with no local expert: a zero
    row, id 0 and weight 0 in slot 0).
dp_combine(y[G, H]) -> [T, H]: this rank's rows r * T .. r * T + T - 1 of every rank's partial
    expert sums, added in rank order (a reduce-scatter).

GPU kernels are not templates: select_kernels gives collective launches the backend "nccl"
and no template, and code generation skips them (the runtime issues them on its stream).
"""
import numpy as np

from .base import REQUIRED, expect, op, tt


def _ranks(ctx, i, x):
    """Every rank's input i of this launch, or [x] alone."""
    ex = getattr(ctx, "exchange", None)
    return [x] if ex is None else ex.inputs(i)


def _world(ctx) -> int:
    return getattr(ctx, "world", 1) or 1


def _rank(ctx) -> int:
    return getattr(ctx, "rank", 0) or 0


def all_reduce(ctx, x, dtype=None):
    parts = _ranks(ctx, 0, x)
    out = np.array(parts[0], np.float32)
    for p in parts[1:]:
        out += p
    return out


def all_gather(ctx, x, axis, world=None):
    return np.concatenate([np.asarray(p, np.float32) for p in _ranks(ctx, 0, x)], axis=axis)


def _gather_infer(types, attrs):
    (x,) = types
    axis, world = attrs["axis"], attrs["world"]
    expect(0 <= axis < len(x.shape) and isinstance(x.shape[axis], int),
           f"all_gather: axis {axis} of {x} is not a static axis")
    shape = list(x.shape)
    shape[axis] *= world
    return [tt(shape, x.dtype)]


def _owned(ctx, T):
    """The rank that owns each token row (sends it out, collects its result)."""
    return np.arange(T) % _world(ctx)


def ep_dispatch(ctx, x, w, ids, experts_per_rank, replicated=False):
    rank, world = _rank(ctx), _world(ctx)
    xs = _ranks(ctx, 0, x)
    if replicated:
        # a local dispatch is right only where the ranks' rows are the same bits
        for r, p in enumerate(xs):
            if not np.array_equal(np.asarray(p), np.asarray(xs[0])):
                raise AssertionError(f"ep_dispatch(replicated): rank {r}'s token rows differ from "
                                     f"rank 0's (max diff {np.abs(np.asarray(p) - xs[0]).max()})")
    owner = _owned(ctx, x.shape[0])
    recv = np.stack([xs[owner[t]][t] for t in range(x.shape[0])]) if x.shape[0] else np.zeros_like(x)
    assert world == len(xs), (world, len(xs))
    return _mask_local(rank, experts_per_rank, recv, w, ids)


def ep_combine(ctx, y):
    # token t's owner (t % N) receives every rank's partial row and adds them in rank order;
    # the all-gather then gives each rank the owners' rows: the sum, the same bits everywhere
    parts = _ranks(ctx, 0, y)
    out = np.array(parts[0], np.float32)
    for p in parts[1:]:
        out += p
    return out


def _equal_tokens(parts, what):
    rows = {np.asarray(p).shape[0] for p in parts}
    if len(rows) > 1:
        raise AssertionError(f"{what}: the ranks' steps have {sorted(rows)} tokens; data-parallel "
                             f"ranks run steps padded to the same T")


def _mask_local(rank, experts_per_rank, x, w, ids):
    """ep_dispatch's masking of rows to this rank's experts (the rows already gathered)."""
    ids = np.asarray(ids, np.int64)
    local = ids // experts_per_rank == rank
    need = local.any(axis=1)
    xr = np.where(need[:, None], x, 0).astype(np.float32)
    wr = np.where(local, w, 0).astype(np.float32)
    idr = np.where(local, ids - rank * experts_per_rank, -1).astype(np.int32)
    idr[~need, 0] = 0
    return xr, wr, idr


def dp_dispatch(ctx, x, w, ids, experts_per_rank):
    xs, ws, idss = (_ranks(ctx, i, a) for i, a in enumerate((x, w, ids)))
    _equal_tokens(xs, "dp_dispatch")
    gather = lambda parts: np.concatenate([np.asarray(p) for p in parts], axis=0)  # noqa: E731
    return _mask_local(_rank(ctx), experts_per_rank, gather(xs).astype(np.float32), gather(ws), gather(idss))


def dp_combine(ctx, y):
    parts = _ranks(ctx, 0, y)
    world, rank = len(parts), _rank(ctx)
    G = np.asarray(parts[0]).shape[0]
    if G % world:
        raise AssertionError(f"dp_combine: {G} rows are not {world} ranks' equal shares")
    T = G // world
    out = np.array(parts[0][rank * T:(rank + 1) * T], np.float32)
    for p in parts[1:]:
        out += p[rank * T:(rank + 1) * T]
    return out


def _dp_dispatch_infer(types, attrs):
    """ep_dispatch's outputs over every rank's rows: G for T."""
    expect(types[0].shape[:1] == ("T",), f"dp_dispatch expects x[T, H], got {types[0]}")
    return [tt(("G",) + t.shape[1:], t.dtype) for t in _dispatch_infer(types, attrs, "dp_dispatch")]


def _dp_combine_infer(types, attrs):
    (y,) = types
    expect(len(y.shape) == 2 and y.shape[0] == "G", f"dp_combine expects every rank's rows y[G, H], got {y}")
    return [tt(("T", y.shape[1]), y.dtype)]


def _dispatch_infer(types, attrs, op="ep_dispatch"):
    x, w, ids = types
    expect(len(x.shape) == 2, f"{op} expects x[T, H], got {x}")
    expect(w.shape == ids.shape and ids.shape[0] == x.shape[0],
           f"{op}: routing weights {w} / ids {ids} do not match x {x}")
    expect(isinstance(attrs["experts_per_rank"], int) and attrs["experts_per_rank"] > 0,
           f"{op}: experts_per_rank must be a positive integer, got {attrs['experts_per_rank']}")
    return [x, tt(w.shape, "f32"), tt(ids.shape, "i32")]


NCCL = {"nccl": None}     # no template: the runtime's communicator runs it
def _reduce_infer(types, attrs):
    (x,) = types
    dtype = attrs.get("dtype") or x.dtype
    expect(dtype in ("bf16", "f32"), f"all_reduce: dtype must be bf16 or f32, got {dtype!r}")
    return [tt(x.shape, dtype)]


op(name="all_reduce", tensors=["x"], infer=_reduce_infer, reference=all_reduce,
   internal=True, collective=True, templates=NCCL, doc="sum over ranks")
op(name="all_gather", tensors=["x"], attrs={"axis": REQUIRED, "world": REQUIRED}, infer=_gather_infer,
   reference=all_gather, internal=True, collective=True, templates=NCCL,
   doc="concatenate the ranks' tensors along an axis")
op(name="ep_dispatch", tensors=["x", "weights", "ids"], attrs={"experts_per_rank": REQUIRED, "replicated": False},
   infer=_dispatch_infer, reference=ep_dispatch, n_outputs=3, internal=True, collective=True,
   templates=NCCL, doc="all-to-all: each token's row to the ranks of its experts")
op(name="dp_dispatch", tensors=["x", "weights", "ids"], attrs={"experts_per_rank": REQUIRED},
   infer=_dp_dispatch_infer, reference=dp_dispatch, n_outputs=3, internal=True, collective=True,
   templates=NCCL, doc="all-gather of every data-parallel rank's token rows, masked to this rank's experts")
op(name="dp_combine", tensors=["y"], infer=_dp_combine_infer, reference=dp_combine, internal=True,
   collective=True, templates=NCCL, doc="reduce-scatter of the experts' partial rows back to their ranks")
op(name="ep_combine", tensors=["y"], infer=lambda types, attrs: [types[0]], reference=ep_combine,
   internal=True, collective=True, templates=NCCL,
   doc="all-to-all back: the experts' partial rows summed at each token's owner, then shared")
