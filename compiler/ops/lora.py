"""LoRA's two launches around a target linear (compiler/passes/add_lora.py makes them):

    lora_shrink(x[T, K], a[S, P*R, K])           -> xa[T, SPLIT*P*R] f32   xa[t, 0] = a[s_t] @ x[t]
    lora_expand(y[T, N], xa, b[S, N, R], scale[S, P]) -> y   y[t, piece p] += scale[s_t, p] *
                  b[s_t, piece p rows] @ round(xa[t, 0, p*R:(p+1)*R])

s_t = step metadata lora_slots[t]: the adapter slot of token t's request, 0 for none. The tables
stack S = max_loras + 1 slots; slot 0 is zeros (and is never written), so a row without an
adapter adds exactly 0. A fused linear (q|k|v, gate|up) has P pieces side by side: its A table
stacks the pieces' [R, K] matrices along the rank (one shrink for all), and output column n of
piece p reads only that piece's R columns of xa (attrs["pieces"]: the pieces' output widths).
An adapter of a rank below R is zero-padded (exact), and its per-piece scale (lora_alpha / r,
or / sqrt(r) with rsLoRA) is applied after the product, as PEFT does.

Split-K: the shrink's K is cut into attrs["split"] ranges (attrs["prefill_split"] <= split of them
outside the decode phase, where the row tiles already fill the GPU), each program summing one range
into its own fp32 partial xa[t, z] (a buffer the plan lays out: [T, split, P*R]), so a batch-1
step runs ~split programs instead of one walking all of K; the last program to arrive adds the
partials in a fixed order (z = 0, 1, ...: no float atomics, a step stays bit-reproducible) into
xa[t, 0], the one split the expand reads. The expand rounds it to y's dtype, as PEFT's lora_A
output is in the model's dtype, then multiplies by B. The kernels take the step's rows grouped by
slot (step metadata lora_rows / lora_segs: runtime/lora/groups.py), a tile of one slot's rows each.
lora_expand_act (passes/fuse_lora_act.py makes it) is a gate|up linear's expand and the gated
activation after it in one launch: act_mul(lora_expand(y, xa, b, scale), fn), y [T, 2F] -> [T, F]
(compiler/ops/gated.py's act_mul), g and u rounded to y's dtype first as the two launches store
them. The references
write the whole sum to split 0 (the others zeros), read split 0 alone and, like the reference
executor everywhere, do not round. The expand adds into y in place (its first output is its first input's
memory).
"""
import numpy as np

from .base import REQUIRED, expect, op, tt
from .gated import act_mul, act_mul_infer


def _slots(ctx, T: int) -> np.ndarray:
    s = np.asarray(ctx.meta.lora_slots, np.int64)
    expect(s.shape == (T,), f"lora: step metadata lora_slots must be [T={T}], got {list(s.shape)}")
    return s


def _split(attrs, op: str) -> int:
    split, pre = attrs["split"], attrs["prefill_split"]
    expect(isinstance(split, int) and isinstance(pre, int) and 1 <= pre <= split,
           f"{op}: split {split} / prefill_split {pre} must be ints with 1 <= prefill_split <= split")
    return split


def shrink_infer(types, attrs):
    x, a = types
    expect(len(a.shape) == 3 and a.shape[2] == x.shape[-1],
           f"lora_shrink: table {a} must be [slots, pieces*rank, K={x.shape[-1]}]")
    expect(x.shape[0] == "T" and len(x.shape) == 2, f"lora_shrink: input must be [T, K], got {x}")
    return [tt((x.shape[0], _split(attrs, "lora_shrink") * a.shape[1]), "f32")]


def shrink_reference(ctx, x, a, split, prefill_split):
    s = _slots(ctx, x.shape[0])
    out = np.zeros((x.shape[0], split, a.shape[1]), np.float32)
    out[:, 0] = np.einsum("trk,tk->tr", a[s], x)
    return out.reshape(x.shape[0], -1)


def expand_infer(types, attrs):
    y, xa, b, scale = types
    pieces, r = attrs["pieces"], attrs["rank"]
    split = _split(attrs, "lora_expand")
    expect(len(b.shape) == 3 and b.shape[1:] == (y.shape[-1], r),
           f"lora_expand: table {b} must be [slots, N={y.shape[-1]}, rank={r}]")
    expect(sum(pieces) == y.shape[-1], f"lora_expand: pieces {pieces} must add up to N={y.shape[-1]}")
    expect(xa.shape == (y.shape[0], split * len(pieces) * r) and xa.dtype == "f32",
           f"lora_expand: xa {xa} must be f32 [T, {split} splits x {len(pieces)} pieces x rank {r}]")
    expect(scale.shape == (b.shape[0], len(pieces)) and scale.dtype == "f32",
           f"lora_expand: scale {scale} must be f32 [slots, {len(pieces)}]")
    return [tt(y.shape, y.dtype)]


def expand_reference(ctx, y, xa, b, scale, pieces, rank, split, prefill_split):
    s = _slots(ctx, y.shape[0])
    xa = np.asarray(xa, np.float32).reshape(y.shape[0], split, -1)[:, 0]       # the shrink's sum
    out = np.array(y, np.float32)
    n0 = 0
    for p, n in enumerate(pieces):
        part = xa[:, p * rank:(p + 1) * rank]
        delta = np.einsum("tnr,tr->tn", b[s, n0:n0 + n], part)
        out[:, n0:n0 + n] += scale[s, p][:, None] * delta
        n0 += n
    return out


op(name="lora_shrink", tensors=["x", "a"], attrs={"split": REQUIRED, "prefill_split": REQUIRED},
   infer=shrink_infer, reference=shrink_reference, internal=True, templates={"triton": "lora_shrink"}, doc="xa = A[slot] x, per token (fp32, split-K partials summed into split 0)")
op(name="lora_expand", tensors=["y", "xa", "b", "scale"], attrs={"pieces": REQUIRED, "rank": REQUIRED, "split": REQUIRED,
                                                   "prefill_split": REQUIRED},
   infer=expand_infer, reference=expand_reference, inplace={0: 0}, internal=True,
   templates={"triton": "lora_expand"}, doc="y += scale[slot] B[slot] xa, per token and piece")


def expand_act_infer(types, attrs):
    (y,) = expand_infer(types, attrs)
    pieces = attrs["pieces"]
    expect(len(pieces) == 2 and pieces[0] == pieces[1],
           f"lora_expand_act: pieces {pieces} must be a [gate | up] pair of equal widths")
    return act_mul_infer([y], attrs)


def expand_act_reference(ctx, y, xa, b, scale, pieces, rank, split, prefill_split, fn):
    return act_mul(ctx, expand_reference(ctx, y, xa, b, scale, pieces, rank, split, prefill_split), fn)


op(name="lora_expand_act", tensors=["y", "xa", "b", "scale"],
   attrs={"pieces": REQUIRED, "rank": REQUIRED, "split": REQUIRED, "prefill_split": REQUIRED, "fn": REQUIRED},
   infer=expand_act_infer, reference=expand_act_reference, internal=True,
   templates={"triton": "lora_expand_act"}, doc="act(gate + dg) * (up + du): gate|up's expand and activation")
