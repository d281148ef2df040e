"""moe_route_table(ids[T] i32, table[V, K] i32) -> (weights f32[T, K], experts i32[T, K]):
a frozen token-id-to-expert table (hash routing: Roller et al.'s Hash Layers, ERNIE-style fixed
assignments): token t goes to the experts table[ids[t], :], each with weight 1 (a spec that
averages them writes mul(y, 1 / K)). The table is a checkpoint tensor (a weight of dtype i32,
read from I32 / I64 storage); its values must be expert ids (0 .. E - 1).

`ids` is the step's tokens; a layer graph sees them where the model carries them through the
layers (`x, tok = layers(x, tokens)`, the body reassigning `tokens = view(tokens, [T])`)."""
import numpy as np

from .base import expect, op, tt


def _infer(types, attrs):
    ids, table = types
    expect(len(ids.shape) == 1 and ids.dtype == "i32", f"moe_route_table ids must be i32 [T] (token ids), got {ids}")
    expect(len(table.shape) == 2 and table.dtype == "i32",
           f"moe_route_table table must be an i32 [V, K] weight (declare it with dtype: i32), got {table}")
    return [tt((ids.shape[0], table.shape[1]), "f32"), tt((ids.shape[0], table.shape[1]), "i32")]


def route_table(ctx, ids, table):
    experts = np.asarray(table)[np.asarray(ids, np.int64)].astype(np.int32)
    return np.ones(experts.shape, np.float32), np.ascontiguousarray(experts)


op(name="moe_route_table", tensors=["ids", "table"], infer=_infer, reference=route_table, n_outputs=2,
   templates={"triton": "moe_route_table"}, doc="hash routing: each token's experts from a frozen [V, K] table, weight 1")
