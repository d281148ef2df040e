"""embedding(ids[T], table[V, H]) -> [T, H]: one row of the table per token."""
from .base import expect, op, tt


def infer(types, attrs):
    ids, table = types
    expect(len(ids.shape) == 1 and ids.dtype == "i32", f"ids must be i32[T], got {ids}")
    expect(len(table.shape) == 2, f"table must be 2-D [V, H], got {table}")
    return [tt((ids.shape[0], table.shape[1]), table.dtype)]


def reference(ctx, ids, table):
    return table[ids]


op(name="embedding", tensors=["ids", "table"], infer=infer, reference=reference,
   templates={"triton": "embedding"}, doc="gather rows of the embedding table")
