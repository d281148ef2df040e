"""pos_embedding(table[P, H]) -> [T, H]: learned absolute position embeddings (GPT-2's wpe).

    out[t, :] = table[positions[t], :]

positions[t] is token t's absolute position in its own sequence (step metadata), so a chunked
prefill or a decode step reads the rows of where its tokens are, not 0..T-1. A position must be
below P: a spec states it as a requirement on its config (GPT-2's `requires: max_len <= P`, the
engine never runs a sequence past max_len); the reference refuses a position past the table
rather than read another row.
"""
import numpy as np

from .base import expect, op, tt


def infer(types, attrs):
    (table,) = types
    expect(len(table.shape) == 2 and all(isinstance(d, int) for d in table.shape),
           f"pos_embedding table must be a static 2-D [P, H] weight, got {table}")
    return [tt(("T", table.shape[1]), table.dtype)]


def reference(ctx, table):
    pos = np.asarray(ctx.positions, np.int64)
    if pos.size and int(pos.max()) >= table.shape[0]:
        raise ValueError(f"pos_embedding: position {int(pos.max())} is past the table's "
                         f"{table.shape[0]} rows (the spec's max_len must not exceed them)")
    return table[pos]


op(name="pos_embedding", tensors=["table"], infer=infer, reference=reference,
   templates={"triton": "pos_embedding"}, doc="learned absolute position embeddings (table rows at positions)")
