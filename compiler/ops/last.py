"""last(x[T, ...]) -> [B, ...]: the row of each sequence's last token in this step."""
from .base import expect, op, tt


def infer(types, attrs):
    (x,) = types
    expect(x.shape[0] == "T", f"last() takes a per-token tensor [T, ...], got {x}")
    return [tt(("B",) + x.shape[1:], x.dtype)]


def reference(ctx, x):
    return x[ctx.last_rows]


op(name="last", tensors=["x"], infer=infer, reference=reference,
   templates={"triton": "gather_last"}, doc="rows of each sequence's last token")
