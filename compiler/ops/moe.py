"""Mixture of experts: softmax top-k routing, then a grouped SwiGLU over the chosen experts.

moe_route(logits[T, E], k, normalize, groups=1, topk_groups=1, scale=1.0, shared=0,
          scoring="softmax", bias=None)
        -> (weights f32[T, k + shared], ids i32[T, k + shared]):
    p = softmax(logits); ids = top-k of p (ties: lower expert id first); weights = p[ids],
    renormalized to sum 1 when `normalize`, then times `scale`. The renormalization divides by
    max(sum + norm_eps, norm_min): ERNIE-4.5's moe_norm_min floor (norm_min), LFM2-MoE's + 1e-6
    (norm_eps); both 0 unless a spec gives them.
    groups > 1 (DeepSeek-V2's group_limited_greedy, n_group / topk_group): the E experts form
    `groups` groups of E / groups consecutive ids; a group scores the largest p among its experts;
    only the `topk_groups` best groups are kept (ties: lower group id first), the other experts'
    p become 0 -- as in transformers they stay eligible, with weight 0, should k exceed the kept
    experts -- and the top-k is taken over that. `scale` (routed_scaling_factor) multiplies the
    final weights, as transformers' DeepseekV2TopkRouter does last. (Transformers 5.x's
    DeepSeek-V2 router never normalizes -- it ignores norm_topk_prob -- so its specs pass
    normalize false; with normalize, the scale follows the normalization, as in DeepSeek-V3.)
    scoring "sigmoid" (DeepSeek-V3's noaux_tc, Kimi-K2's and GLM-4.5's router): s = sigmoid(logits)
    and, with `bias` (e_score_correction_bias [E], f32), the choice scores c = s + bias; a group
    scores the sum of its two largest c; the experts of the groups not kept are out of the choice
    (as -inf in transformers); ids = top-k of c; weights = s[ids] (the bias only chooses),
    renormalized when `normalize`, then times `scale`. group_score="top2" scores a softmax
    router's groups by the sum of their two largest p too (Mistral-Small-4's Mistral4TopkRouter;
    the dropped groups' p become 0 as above); "max" is softmax's default, and sigmoid's groups are
    always scored by their two best. Softmax scoring with a bias chooses by
    p + bias likewise; scoring "sqrtsoftplus" (DeepSeek-V4: s = sqrt(softplus(logits)), torch's
    softplus) chooses and weighs as sigmoid does, without groups.
    shared > 0 (compiler/passes/fold_shared_experts.py sets it): every token also
    names the always-on experts E .. E + shared - 1 (a model's shared experts, stacked after the
    routed ones), in slots k .. k + shared - 1, with weight 1 (unscaled, unnormalized).
    Ties: transformers takes torch.topk(sorted=False), which promises no order among equal
    scores; here (reference and kernel alike) the lower id wins, for groups and experts.
    groups, topk_groups, group_score, norm_eps, norm_min, scale, shared and scoring are extra attrs and bias a keyword-only optional
    tensor (base.OpDef.extra_attrs / keyword_optional): a node carries them only where its spec
    gives them, so the plans of specs that don't are unchanged.
moe_experts(x[T, H], weights, ids, gate[E, F, H], up[E, F, H], down[E, H, F],
            gate_bias[E, F], up_bias[E, F], down_bias[E, H] optional, act="silu", alpha, limit) -> [T, H]:
    y[t] = sum_j weights[t, j] * (down[e] @ act(gate[e] @ x[t] + gb[e], up[e] @ x[t] + ub[e]) + db[e]),
    e = ids[t, j]; act a gated activation of ops/gated_act.py (SwiGLU, or GPT-OSS's clamped
    form with alpha and limit). The biases and act are extra (absent: plans unchanged).
    weigh="input" (Llama-4's Llama4TextMoe): the weights scale each expert's input instead,
    y[t] = sum_j expert_e(weights[t, j] * x[t]); lowered for one expert a token (top-1, Llama-4's)
    without expert biases as mul(x, weights) then the experts with moe_down's `unweighted`.
    A slot of id -1 names no expert and adds nothing: expert parallelism's ep_dispatch gives the
    slots of other ranks' experts id -1 (ops/collectives.py), so a rank computes only its own.

Lowered (compiler/passes/lower_experts.py) into internal ops:
moe_align(ids[T, k], experts=E) -> (rows i32[E, T], counts i32[E]): the tokens grouped by expert,
    for the grouped GEMMs of prefill: counts[e] = how many tokens chose e (a token naming e in
    several slots counts once; slots of id -1 count nowhere), rows[e, :counts[e]] those
    tokens. The reference lists them in token order; the kernel in arrival order (each token's
    result does not depend on its place in the list, so the outputs are the same bits).
moe_route_align(logits, k, normalize, experts) -> (weights, ids, rows, counts): moe_route then
    moe_align in one launch (compiler/passes/fuse_moe.py); its decode kernel routes only (the
    decode kernels group the few tokens themselves and never read rows/counts).
moe_gate_up(x, ids, gate_up, rows, counts[, bias[E, 2F]]) / moe_down(act, weights, ids, down, rows,
    counts[, bias[E, H]]): the two expert launches (moe_gate_up applies the gated act); rows/counts are read by the prefill/mixed kernels only. The kernels
    compute each (token, expert) once: a token that names an expert in several slots gets the
    same act row in each (moe_gate_up), and moe_down reads the act row of the slot of largest
    weight for all of them, which equals the reference whenever the other slots weigh 0 (the one
    way a token repeats an expert: ep_dispatch's zero-weight slot 0, id 0, of a token that has no
    expert on the rank, see ops/collectives.py). A slot of id -1 has no act row (moe_gate_up
    leaves it unwritten; the reference, zero) and no part in y.
    A quantized checkpoint's experts (compiler/passes/quantize_weights.py) are stacked codes
    [E, N, K] with their companions (w_scale [E, ...], ...) after counts, attrs["quant"] the
    scheme: the reference dequantizes them and quantizes the activations entering each
    projection (x for gate_up, each act row for down) as ops/quant.py defines. With ready codes
    (attrs.has_a_scale: compiler/passes/act_codes.py) x (or act) is the e4m3 codes a launch before
    made, their f32 scales [..., groups] after the companions; the outputs stay bf16. With
    attrs.has_w_upcast (compiler/passes/upcast_experts.py) the stack dequantized to bf16 once
    (ops/expert_upcast.py) is the last input: the grouped kernels read it in steps of at least
    attrs.upcast_rows rows, the reference (and every other kernel) the codes.
"""
import numpy as np

from .activation import softplus
from .base import REQUIRED, expect, op, tt
from .expert_upcast import stack_written
from .gated_act import GATED_EXTRA, check as check_act, gated
from .quant import CODES_OPTIONAL, check_types, expert_operands


SCORING = ("softmax", "sigmoid", "sqrtsoftplus")



def route_infer(types, attrs):
    logits, *bias = types
    k = attrs["k"]
    expect(len(logits.shape) == 2, f"router logits must be [T, E], got {logits}")
    expect(not bias or tuple(bias[0].shape) == (logits.shape[1],),
           f"moe_route bias must be [E] = [{logits.shape[1]}], got {bias[0] if bias else None}")
    scoring = attrs.get("scoring", "softmax")
    expect(scoring in SCORING, f"moe_route scoring must be one of {', '.join(SCORING)}, got {scoring!r}")
    expect(scoring != "sqrtsoftplus" or attrs.get("groups", 1) == 1,
           "moe_route scoring sqrtsoftplus (DeepSeek-V4) with groups is not a router any model defines")
    expect(scoring != "sigmoid" or attrs.get("groups", 1) == 1 or logits.shape[1] // attrs["groups"] >= 2,
           "moe_route scoring sigmoid scores a group by its two best experts: groups need 2 experts or more")
    expect(not (bias and scoring == "softmax" and attrs.get("groups", 1) > 1),
           "moe_route: a bias with softmax scoring and groups is not a router any model defines")
    group_score = attrs.get("group_score", "max")
    expect(group_score in ("max", "top2"),
           f"moe_route group_score must be 'max' (a group's best score) or 'top2' (the sum of its two "
           f"best), got {group_score!r}")
    expect(group_score == "max" or (scoring == "softmax" and attrs.get("groups", 1) > 1
                                    and logits.shape[1] // attrs["groups"] >= 2),
           "moe_route group_score='top2' applies to softmax scores in groups of 2 experts or more "
           "(sigmoid groups are always scored by their two best)")
    expect(isinstance(k, int) and 0 < k <= logits.shape[1], f"top-k {k} not in 1..{logits.shape[1]}")
    groups, topk_groups = attrs.get("groups", 1), attrs.get("topk_groups", 1)
    expect(isinstance(groups, int) and groups > 0 and logits.shape[1] % groups == 0,
           f"moe_route groups {groups} must be a positive int dividing the {logits.shape[1]} experts")
    expect(isinstance(topk_groups, int) and 0 < topk_groups <= groups,
           f"moe_route topk_groups {topk_groups} not in 1..{groups} (groups)")
    scale = attrs.get("scale", 1.0)
    expect(isinstance(scale, (int, float)) and not isinstance(scale, bool),
           f"moe_route scale must be a number, got {scale!r}")
    for a in ("norm_eps", "norm_min"):
        v = attrs.get(a, 0.0)
        expect(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0,
               f"moe_route {a} must be a non-negative number, got {v!r}")
        expect(v == 0 or attrs.get("normalize", False),
               f"moe_route {a} applies to the renormalization: give normalize true with it")
    shared = attrs.get("shared", 0)
    expect(isinstance(shared, int) and not isinstance(shared, bool) and shared >= 0,
           f"moe_route shared must be a non-negative int, got {shared!r}")
    return [tt((logits.shape[0], k + shared), "f32"), tt((logits.shape[0], k + shared), "i32")]


def scores(logits, scoring):
    """Every expert's router score [T, E] (f32): softmax, sigmoid or sqrtsoftplus of the logits."""
    l = np.asarray(logits, np.float32)
    if scoring == "sigmoid":
        return 1.0 / (1.0 + np.exp(-l))
    if scoring == "sqrtsoftplus":
        return np.sqrt(softplus(l))
    p = np.exp(l - l.max(-1, keepdims=True))
    return p / p.sum(-1, keepdims=True)


def with_shared(w, ids, num_experts: int, shared: int):
    """The routers' always-on slots (fold_shared_experts): experts E .. E + shared - 1 after each
    token's chosen ones, at weight 1."""
    if not shared:
        return w, ids
    T = len(ids)
    w = np.concatenate([w, np.ones((T, shared), np.float32)], axis=1)
    ids = np.concatenate([ids, np.broadcast_to(np.arange(num_experts, num_experts + shared, dtype=np.int32),
                                               (T, shared))], axis=1)
    return w, ids


def route(ctx, logits, *bias, k, normalize=False, groups=1, topk_groups=1, scale=1.0, shared=0,
          scoring="softmax", has_bias=False, group_score="max", norm_eps=0.0, norm_min=0.0):
    p = scores(logits, scoring)
    c = p + bias[0].astype(np.float32) if bias else p      # the scores that choose
    if groups > 1:
        T, E = p.shape
        per = c.reshape(T, groups, E // groups)
        # sigmoid (noaux_tc) and group_score top2: a group scores its two best; softmax
        # (group_limited_greedy): its best
        top2 = scoring == "sigmoid" or group_score == "top2"
        best = np.sort(per, -1)[..., -2:].sum(-1) if top2 else per.max(-1)
        kept = np.argsort(-best, axis=-1, kind="stable")[:, :topk_groups]
        keep = np.zeros((T, groups), bool)
        np.put_along_axis(keep, kept, True, axis=-1)
        keep = np.repeat(keep, E // groups, axis=1)
        if scoring == "sigmoid":     # the dropped groups' experts are out of the choice
            c = np.where(keep, c, np.float32(-np.inf))
        else:                        # group_limited_greedy (no bias): they score 0 (weight 0 if chosen)
            p = c = np.where(keep, p, np.float32(0))
    ids = np.argsort(-c, axis=-1, kind="stable")[:, :k].astype(np.int32)
    w = np.take_along_axis(p, ids, axis=-1)
    if normalize:
        w = w / np.maximum(w.sum(-1, keepdims=True) + np.float32(norm_eps), np.float32(norm_min))
    if scale != 1.0:
        w = w.astype(np.float32) * np.float32(scale)
    w, ids = with_shared(w.astype(np.float32), ids, p.shape[1], shared)
    return w, np.ascontiguousarray(ids)


WEIGH = ("output", "input")


def experts_infer(types, attrs):
    x, w, ids, gate, up, down = types[:6]
    check_act(attrs, "moe_experts")
    weigh = attrs.get("weigh", "output")
    expect(weigh in WEIGH, f"moe_experts weigh must be one of {', '.join(WEIGH)}, got {weigh!r}")
    # the input-weighted experts' kernels scale the token row once (compiler/passes/lower_experts.py)
    expect(weigh == "output" or (w.shape[-1] == 1 and not any(attrs.get(f"has_{b}") for b in EXPERT_BIASES)),
           f"moe_experts weigh='input' takes one expert a token (routing weights [T, 1], got {w}) and "
           f"no expert biases: a top-k above 1 or biases with input weighting have no kernel")
    biases = iter(types[6:])
    for name, rows in zip(EXPERT_BIASES, (gate.shape[1], gate.shape[1], x.shape[-1])):
        if attrs.get(f"has_{name}"):
            b = next(biases, None)
            expect(b is not None and tuple(b.shape) == (gate.shape[0], rows),
                   f"moe_experts: {name} must be [{gate.shape[0]}, {rows}] (one row per expert), got {b}")
    expect(len(gate.shape) == 3 and gate.shape == up.shape, f"expert gate/up must be [E, F, H]: {gate}, {up}")
    expect(gate.shape[2] == x.shape[-1], f"expert gate K={gate.shape[2]} != hidden {x.shape[-1]}")
    expect(tuple(down.shape) == (gate.shape[0], x.shape[-1], gate.shape[1]),
           f"expert down must be [E, H, F] = [{gate.shape[0]}, {x.shape[-1]}, {gate.shape[1]}], got {down}")
    expect(w.shape == ids.shape, f"routing weights {w} and ids {ids} differ")
    return [x]


def _chosen(ids):
    """The experts the slots name (id -1: none)."""
    return [e for e in np.unique(ids) if e >= 0]


EXPERT_BIASES = ("gate_bias", "up_bias", "down_bias")


def bias_inputs(inputs: list, attrs: dict) -> dict:
    """moe_experts' bias inputs by name (those its attrs say are present), in input order."""
    extra = iter(inputs[6:])
    return {b: next(extra) for b in EXPERT_BIASES if attrs.get(f"has_{b}")}


def experts(ctx, x, w, ids, gate, up, down, *biases, act="silu", alpha=1.702, limit=7.0, weigh="output", **has):
    biases = iter(biases)
    gb, ub, db = (next(biases) if has.get(f"has_{n}") else None for n in EXPERT_BIASES)
    y = np.zeros_like(x, dtype=np.float32)
    for e in _chosen(ids):
        rows, slot = np.nonzero(ids == e)
        xe = x[rows]
        if weigh == "input":          # Llama-4: the expert sees the token scaled by its weight
            xe, o_w = xe * w[rows, slot][:, None], np.ones(len(rows), np.float32)
        else:
            o_w = w[rows, slot]
        g, u = xe @ gate[e].T, xe @ up[e].T
        g, u = g if gb is None else g + gb[e], u if ub is None else u + ub[e]
        o = gated(g, u, act, alpha, limit) @ down[e].T
        o = o if db is None else o + db[e]
        np.add.at(y, rows, o * o_w[:, None])
    return y


# The experts split in two launches, because the down projection needs every column of the
# activation: moe_gate_up(x, ids, gate_up[E, 2F, H]) -> act[T, k, F] = silu(g) * u per chosen
# expert, then moe_down(act, weights, ids, down[E, H, F]) -> y[t] = sum_j w[t, j] down[e] act[t, j].
def _check_bias(types, attrs, w, who):
    """The expert bias [E, N] at types[0] when attrs has_bias; returns how many inputs it takes."""
    if not attrs.get("has_bias"):
        return 0
    expect(len(types) > 0 and tuple(types[0].shape) == tuple(w.shape[:2]),
           f"{who}: bias must be [{w.shape[0]}, {w.shape[1]}] (one row per expert), got {types[:1]}")
    return 1


def _check_upcast(types, attrs, w, who):
    """The stack dequantized once (attrs.has_w_upcast: expert_upcast's bf16 [E, N, K], the last
    input; compiler/passes/upcast_experts.py), read by the grouped GEMMs in steps of at least
    attrs.upcast_rows rows."""
    if not attrs.get("has_w_upcast"):
        return
    u = types[-1]
    expect(attrs.get("quant") is not None and u.dtype == "bf16" and tuple(u.shape) == tuple(w.shape),
           f"{who}: the upcast stack must be bf16 {list(w.shape)} beside quantized experts, got {u}")
    expect(isinstance(attrs.get("upcast_rows"), int) and attrs["upcast_rows"] > 0,
           f"{who}: upcast_rows must be a positive int, got {attrs.get('upcast_rows')!r}")


def gate_up_infer(types, attrs):
    x, ids, gu = types[:3]
    _check_upcast(types, attrs, gu, "moe_gate_up")
    _check_grouping(types[3:5], ids, gu.shape[0])
    check_act(attrs, "moe_gate_up")
    nb = _check_bias(types[5:], attrs, gu, "moe_gate_up")
    check_types(types, attrs, 5 + nb, "moe_gate_up", w_at=2)
    expect(len(gu.shape) == 3 and gu.shape[2] == x.shape[-1] and gu.shape[1] % 2 == 0,
           f"expert gate_up must be [E, 2F, H]: {gu}")
    return [tt((x.shape[0], ids.shape[1], gu.shape[1] // 2), _out_dtype(x))]


def gate_up(ctx, x, ids, gu, expert_rows=None, expert_counts=None, *rest, **attrs):
    # rows/counts (moe_align's grouping) only tell the prefill kernels where to look: the result
    # is defined by ids alone; the bias, then a quantized stack's companions follow them (ops/quant.py)
    bias, quant = (rest[0], rest[1:]) if attrs.get("has_bias") else (None, rest)
    x, gu = expert_operands(x, gu, quant, attrs, stack_written(ctx, x.shape[0], attrs))
    act = {a: attrs.get(a, d) for a, d in GATED_EXTRA.items()}
    f = gu.shape[1] // 2
    out = np.zeros((x.shape[0], ids.shape[1], f), np.float32)
    for e in _chosen(ids):
        rows, slot = np.nonzero(ids == e)
        h = x[rows] @ gu[e].T
        if bias is not None:
            h = h + bias[e]
        out[rows, slot] = gated(h[:, :f], h[:, f:], **act)
    return out


def down_infer(types, attrs):
    act, w, ids, down = types[:4]
    _check_upcast(types, attrs, down, "moe_down")
    _check_grouping(types[4:6], ids, down.shape[0])
    nb = _check_bias(types[6:], attrs, down, "moe_down")
    check_types(types, attrs, 6 + nb, "moe_down", w_at=3)
    expect(len(down.shape) == 3 and down.shape[2] == act.shape[2], f"expert down must be [E, H, F]: {down}")
    return [tt((act.shape[0], down.shape[1]), _out_dtype(act))]


def _out_dtype(x):
    # ready activation codes (attrs.has_a_scale) stand for the bf16 activations they were made from
    return "bf16" if x.dtype == "f8e4m3" else x.dtype


def down(ctx, act, w, ids, down_w, expert_rows=None, expert_counts=None, *rest, **attrs):
    bias, quant = (rest[0], rest[1:]) if attrs.get("has_bias") else (None, rest)
    if attrs.get("unweighted"):      # the weights went into the experts' input (weigh="input")
        w = np.where(np.asarray(ids) >= 0, np.float32(1), np.float32(0))
    act, down_w = expert_operands(act, down_w, quant, attrs, stack_written(ctx, act.shape[0], attrs))
    y = np.zeros((act.shape[0], down_w.shape[1]), np.float32)
    for e in _chosen(ids):
        rows, slot = np.nonzero(ids == e)
        o = act[rows, slot] @ down_w[e].T
        if bias is not None:
            o = o + bias[e]
        # add.at: a token may name an expert twice, and y[rows] += would keep only one of them
        np.add.at(y, rows, o * w[rows, slot][:, None])
    return y


def _check_grouping(types, ids, experts):
    """moe_gate_up / moe_down's trailing rows[E, T] and counts[E] (moe_align's outputs)."""
    expect(len(types) == 2, f"expected moe_align's rows and counts after the weights, got {len(types)} tensors")
    rows, counts = types
    expect(tuple(rows.shape) == (experts, ids.shape[0]) and rows.dtype == "i32",
           f"expert rows must be i32 [{experts}, {ids.shape[0]}], got {rows}")
    expect(tuple(counts.shape) == (experts,) and counts.dtype == "i32",
           f"expert counts must be i32 [{experts}], got {counts}")


def align_infer(types, attrs):
    (ids,) = types
    e = attrs["experts"]
    expect(len(ids.shape) == 2 and ids.dtype == "i32", f"moe_align ids must be i32 [T, k], got {ids}")
    expect(isinstance(e, int) and e > 0, f"moe_align experts must be a positive int, got {e}")
    return [tt((e, ids.shape[0]), "i32"), tt((e,), "i32")]


def align(ctx, ids, experts):
    ids = np.asarray(ids, np.int64)
    T = ids.shape[0]
    rows = np.zeros((experts, T), np.int32)
    counts = np.zeros(experts, np.int32)
    for e in range(experts):
        toks = np.nonzero((ids == e).any(axis=1))[0]
        counts[e] = len(toks)
        rows[e, :len(toks)] = toks
    return rows, counts


def route_align_infer(types, attrs):
    w, ids = route_infer(types, attrs)
    return [w, ids] + align_infer([ids], attrs)


def route_align(ctx, logits, *bias, k, normalize=False, experts=None, **route_attrs):
    w, ids = route(ctx, logits, *bias, k=k, normalize=normalize, **route_attrs)
    return (w, ids) + align(ctx, ids, experts if experts is not None else logits.shape[1])


ROUTE_EXTRA = {"groups": 1, "topk_groups": 1, "scale": 1.0, "shared": 0, "scoring": "softmax",
               "group_score": "max", "norm_eps": 0.0, "norm_min": 0.0}
op(name="moe_route", tensors=["logits"], attrs={"k": REQUIRED, "normalize": False}, extra_attrs=ROUTE_EXTRA,
   keyword_optional=["bias"],
   infer=route_infer, reference=route, n_outputs=2, templates={"triton": "moe_route"},
   doc="top-k router (softmax or sigmoid scores, group-limited, a choice bias)")
op(name="moe_experts", tensors=["x", "weights", "ids", "gate", "up", "down"],
   extra_optional=list(EXPERT_BIASES), extra_attrs={**GATED_EXTRA, "weigh": "output"},
   infer=experts_infer, reference=experts,   # no kernel of its own: lower_experts splits it
   doc="grouped SwiGLU experts, weighted sum over the top-k")
op(name="moe_align", tensors=["ids"], attrs={"experts": REQUIRED}, infer=align_infer, reference=align,
   n_outputs=2, internal=True, templates={"triton": "moe_align"},
   doc="tokens grouped by expert (counts, per-expert token lists) for the grouped expert GEMMs")
op(name="moe_route_align", tensors=["logits"], attrs={"k": REQUIRED, "normalize": False, "experts": REQUIRED},
   extra_attrs=ROUTE_EXTRA, keyword_optional=["bias"],
   infer=route_align_infer, reference=route_align, n_outputs=4, internal=True,
   templates={"triton": "moe_route"},
   doc="moe_route + moe_align in one launch (prefill/mixed/wide; decode routes only)")
# a quantized stack's companions, ready codes' scales (compiler/passes/act_codes.py), then the
# stack dequantized once (compiler/passes/upcast_experts.py)
EXPERT_PASS_INPUTS = CODES_OPTIONAL + ["w_upcast"]
# decode (a few tokens): one program per (distinct chosen expert, row block), a GEMV over the
# expert's rows for the tokens that chose it; prefill/mixed (and short, through mixed) and wide
# decode steps (many sequences: compiler/passes/select_kernels.py WIDE_TOKENS_PER_EXPERT): grouped
# tensor-core GEMMs over moe_align's per-expert token lists
op(name="moe_gate_up", tensors=["x", "ids", "gate_up", "rows", "counts"], extra_optional=["bias"],
   extra_attrs=GATED_EXTRA, pass_inputs=EXPERT_PASS_INPUTS,
   infer=gate_up_infer, reference=gate_up, internal=True, templates={"triton": {"prefill": "moe_gate_up_grouped", "mixed": "moe_gate_up_grouped",
                                        "decode": "moe_gate_up", "wide": "moe_gate_up_grouped"}},
   doc="per chosen expert: silu(x gate^T) * (x up^T)")
op(name="moe_down", tensors=["act", "weights", "ids", "down", "rows", "counts"], extra_optional=["bias"],
   pass_inputs=EXPERT_PASS_INPUTS, extra_attrs={"unweighted": False},
   infer=down_infer, reference=down, internal=True, templates={"triton": {"prefill": "moe_down_grouped", "mixed": "moe_down_grouped",
                                        "decode": "moe_down", "wide": "moe_down_grouped"}},
   doc="per token: routing-weighted sum of the chosen experts' down projections")
