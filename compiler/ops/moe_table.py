"""moe_route_table(ids[T] i32, table[V, K] i32) -> (weights f32[T, K], experts i32[T, K]):
a frozen token-id-to-expert table (hash routing: Roller et al.'s Hash Layers, ERNIE-style fixed
assignments): token t goes to the experts table[ids[t], :], each with weight 1 (a spec that
averages them writes mul(y, 1 / K)). The table is a checkpoint tensor (a weight of dtype i32,
read from I32 / I64 storage); its values must be expert ids (0 .. E - 1).

With the router's logits (DeepSeek-V4's hash-MoE layers, DeepseekV4HashRouter): only the choice is
frozen; the weights are the router's scores of the chosen experts,
    moe_route_table(ids, table, logits=l[T, E], scoring="sqrtsoftplus", normalize=true, scale=rsf):
    s = score(l) (scoring as moe_route's: softmax, sigmoid or sqrtsoftplus), weights[t, j] =
    s[t, table[ids[t], j]], divided by their sum when `normalize`, then times `scale`
    (routed_scaling_factor). logits, scoring, normalize and scale are extra (absent: the plans of
    specs that don't give them are unchanged); scoring, normalize and scale need logits.

shared = n > 0 (compiler/passes/fold_shared_experts.py sets it, as moe_route's): every token also
names the always-on experts E .. E + n - 1 (the model's shared experts stacked after the E routed
ones; E from logits, which it needs) in slots K .. K + n - 1, with weight 1 (unscaled, unnormalized).

`ids` is the step's tokens; a layer graph sees them where the model carries them through the
layers (`x, tok = layers(x, tokens)`, the body reassigning `tokens = view(tokens, [T])`)."""
import numpy as np

from .base import expect, op, tt
from .moe import SCORING, scores, with_shared


TABLE_EXTRA = {"scoring": "softmax", "normalize": False, "scale": 1.0, "shared": 0}


def _infer(types, attrs):
    ids, table, *logits = types
    expect(len(ids.shape) == 1 and ids.dtype == "i32", f"moe_route_table ids must be i32 [T] (token ids), got {ids}")
    expect(len(table.shape) == 2 and table.dtype == "i32",
           f"moe_route_table table must be an i32 [V, K] weight (declare it with dtype: i32), got {table}")
    scored = [a for a in TABLE_EXTRA if a in attrs and a != "shared"]
    expect(logits or not scored,
           f"moe_route_table: {', '.join(scored)} weigh the chosen experts by the router's scores: give logits=")
    shared = attrs.get("shared", 0)
    expect(isinstance(shared, int) and not isinstance(shared, bool) and shared >= 0,
           f"moe_route_table shared must be a non-negative int, got {shared!r}")
    expect(logits or not shared, "moe_route_table shared experts are numbered after the router's E: give logits=")
    if logits:
        lg = logits[0]
        expect(len(lg.shape) == 2 and lg.shape[0] == ids.shape[0],
               f"moe_route_table logits must be [T, E] (one row a token, like ids {ids}), got {lg}")
        expect(attrs.get("scoring", "softmax") in SCORING,
               f"moe_route_table scoring must be one of {', '.join(SCORING)}, got {attrs.get('scoring')!r}")
        expect(isinstance(attrs.get("normalize", False), bool),
               f"moe_route_table normalize must be true or false, got {attrs.get('normalize')!r}")
        sc = attrs.get("scale", 1.0)
        expect(isinstance(sc, (int, float)) and not isinstance(sc, bool), f"moe_route_table scale must be a number, got {sc!r}")
    n = table.shape[1] + shared
    return [tt((ids.shape[0], n), "f32"), tt((ids.shape[0], n), "i32")]


def route_table(ctx, ids, table, *logits, scoring="softmax", normalize=False, scale=1.0, shared=0,
                has_logits=False):
    experts = np.asarray(table)[np.asarray(ids, np.int64)].astype(np.int32)
    if not logits:
        return np.ones(experts.shape, np.float32), np.ascontiguousarray(experts)
    w = np.take_along_axis(scores(logits[0], scoring), experts.astype(np.int64), axis=-1)
    if normalize:
        w = w / w.sum(-1, keepdims=True)
    w, experts = with_shared((w * np.float32(scale)).astype(np.float32), experts, np.shape(logits[0])[-1], shared)
    return w, np.ascontiguousarray(experts)


op(name="moe_route_table", tensors=["ids", "table"], keyword_optional=["logits"], extra_attrs=TABLE_EXTRA, infer=_infer, reference=route_table, n_outputs=2,
   templates={"triton": "moe_route_table"}, doc="hash routing: each token's experts from a frozen [V, K] table, weight 1 or the router's scores")
