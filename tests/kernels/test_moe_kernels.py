"""MoE templates under the interpreter, against their ops' numpy references.

Decode (moe_gate_up, moe_down: per distinct chosen expert, CUDA-core and tensor-core paths, the
deterministic slot-order combine), the token grouping (moe_align, moe_route_align) and the
prefill/mixed grouped GEMMs (moe_gate_up_grouped, moe_down_grouped). Small shapes that no block
divides (H=48, F=40, E=10 experts), T in {1, 3, 37} tokens, k in {1, 2, 8} slots, and the
expert-parallel case where a token names expert 0 in several zero-weight slots.
"""
import numpy as np
import pytest
import torch

from infc.compiler.ops import REGISTRY

from .harness import bf16, poison, rand, rel_err, render, run
from .test_gemm_kernels import hf_gated

TOL = 1e-2
H, F, E = 48, 40, 10


def f32(t):
    return t.float().numpy()


def routing(T, KT, E, gen, ep=False):
    """ids i32 [T, KT] (distinct experts per token) and weights f32 [T, KT]. ep=True: as
    ep_dispatch leaves them, slots of experts on other ranks get id -1 and weight 0, and a token
    with no local expert (token 0 and any other) slot 0 = expert 0 with weight 0. ep="dup": those slots
    id 0 and weight 0 instead, so 0 repeats in a row (ids that moe_route does not make, which
    the kernels still compute right)."""
    ids = np.stack([gen.choice(E, size=KT, replace=False) for _ in range(T)]).astype(np.int32)
    w = (gen.random((T, KT)) + 0.1).astype(np.float32)
    if ep:
        far = gen.random((T, KT)) < 0.4
        far[0, :] = True                                 # a token with no local expert at all
        ids[far], w[far] = (0 if ep == "dup" else -1), 0.0
        ids[far.all(1), 0] = 0                           # no local expert: expert 0, weight 0
    return torch.from_numpy(ids), torch.from_numpy(w)


def named(act, ids):
    """act [T, KT, F] where a slot names an expert (a slot of id -1 has no act row)."""
    return act[ids.numpy() >= 0]


def weights(E, H, F, gen):
    return rand((E, 2 * F, H), gen=gen, scale=H ** -0.5), rand((E, H, F), gen=gen, scale=F ** -0.5)


def gate_up_inputs(KT):
    spec = [("x", ["T", H], "bf16"), ("ids", ["T", KT], "i32"), ("gate_up", [E, 2 * F, H], "bf16", "weight"),
            ("rows", [E, "T"], "i32"), ("counts", [E], "i32")]
    return spec, [("act", ["T", KT, F], "bf16")]


def down_inputs(KT):
    spec = [("act", ["T", KT, F], "bf16"), ("weights", ["T", KT], "f32"), ("ids", ["T", KT], "i32"),
            ("down", [E, H, F], "bf16", "weight"), ("rows", [E, "T"], "i32"), ("counts", [E], "i32")]
    return spec, [("y", ["T", H], "bf16")]


def zero_counters(scratch):
    for name, s in scratch.items():
        if name.startswith("counter"):
            assert int(s.abs().sum()) == 0, f"scratch '{name}' not left zero"


# (T, KT, ep, tune): T=1 and few tokens take the CUDA-core path, 37 tokens over 10 experts the
# tensor-core path (several BLOCK_T groups per expert); FMA_T=2 mixes both in one launch; FMA_T=0
# puts every token count, batch 1 included, on tensor cores.
DECODE = [
    (1, 1, False, {}),
    (1, 8, False, {}),
    (1, 8, True, {}),
    (1, 8, True, {"FMA_T": 0}),
    (3, 8, "dup", {"FMA_T": 0, "TC": 16}),
    (3, 2, False, {}),
    (3, 2, False, {"FMA_T": 2}),
    (3, 8, True, {"TC": 16}),
    (37, 8, False, {"BLOCK_T": 16, "TC": 16, "PC": 64}),
    (37, 2, True, {"FMA_T": 4, "BLOCK_K": 32}),
    (37, 1, False, {}),
    (3, 8, "dup", {"TC": 16}),
    (37, 2, "dup", {"FMA_T": 4, "BLOCK_K": 32}),
]


@pytest.mark.parametrize("T,KT,ep,tune", DECODE)
def test_moe_gate_up_decode(T, KT, ep, tune):
    gen = np.random.default_rng(T * 100 + KT)
    ids, _ = routing(T, KT, E, gen, ep)
    x = rand((T, H), gen=gen)
    gu, _ = weights(E, H, F, gen)
    ins, outs = gate_up_inputs(KT)
    k = render("moe_gate_up", "moe_gate_up", ins, outs, tune=tune)
    act = poison((T, KT, F))
    run(k, {"in:0": x, "in:1": ids, "in:2": gu, "out:0": act}, {"T": T, "B": T})
    want = REGISTRY["moe_gate_up"].reference(None, f32(x), ids.numpy(), f32(gu))
    assert rel_err(named(f32(act), ids), named(want, ids)) <= TOL
    assert_gated_order(act, x, ids, gu)


def assert_gated_order(act, x, ids, gu):
    """The experts' act: g and u rounded to bf16 (as HF's projections are), then one rounding of
    silu(g) * u, where HF rounds silu(g) too (act_mul.py.j2 says why). Emulated in float64 (the
    kernel's fp32 sums round the other way now and then), against HF's order, which matches far
    fewer elements."""
    i = ids.numpy()
    t, j = np.nonzero(i >= 0)
    w = f32(gu).astype(np.float64)[i[t, j]]                    # [n, 2F, H]
    hf, once = hf_gated(bf16(np.einsum("nfh,nh->nf", w, f32(x).astype(np.float64)[t])), "silu")
    got = f32(act)[t, j]
    assert (got == once).mean() >= 0.97
    assert (got == hf).mean() < 0.92


@pytest.mark.parametrize("T,KT,ep,tune", DECODE)
def test_moe_down_decode(T, KT, ep, tune):
    gen = np.random.default_rng(T * 100 + KT + 7)
    ids, rw = routing(T, KT, E, gen, ep)
    act = rand((T, KT, F), gen=gen, scale=0.5)
    _, down = weights(E, H, F, gen)
    ins, outs = down_inputs(KT)
    k = render("moe_down", "moe_down", ins, outs, tune={**tune, "BLOCK_H": 16} if tune else {})
    y = poison((T, H))
    bindings = {"in:0": act, "in:1": rw, "in:2": ids, "in:3": down, "out:0": y}
    zero_counters(run(k, bindings, {"T": T, "B": T}))
    want = REGISTRY["moe_down"].reference(None, f32(act), rw.numpy(), ids.numpy(), f32(down))
    assert rel_err(f32(y), want) <= TOL
    # deterministic: a second launch (the counters were left zero) gives the same bits
    y2 = poison((T, H))
    run(k, {**bindings, "out:0": y2}, {"T": T, "B": T})
    assert torch.equal(y.view(torch.int16), y2.view(torch.int16))


def check_grouping(rows, counts, ids, E):
    """counts exact; each expert's list holds its tokens once each (any order)."""
    want_rows, want_counts = REGISTRY["moe_align"].reference(None, ids, experts=E)
    assert np.array_equal(counts, want_counts)
    for e in range(E):
        assert sorted(rows[e, :counts[e]].tolist()) == want_rows[e, :want_counts[e]].tolist(), e


@pytest.mark.parametrize("T,KT,ep,tb", [(1, 1, False, 64), (1, 8, True, 64), (3, 2, False, 2),
                                        (37, 8, False, 8), (37, 8, True, 16), (37, 1, False, 64),
                                        (37, 8, "dup", 16)])
def test_moe_align(T, KT, ep, tb):
    ids, _ = routing(T, KT, E, np.random.default_rng(T + KT), ep)
    k = render("moe_align", "moe_align", [("ids", ["T", KT], "i32")],
               [("rows", [E, "T"], "i32"), ("counts", [E], "i32")], {"experts": E}, phase="prefill",
               tune={"TB": tb})
    for _ in range(2):                       # the cursors are left zero for the next launch
        rows, counts = poison((E, T), "i32"), poison((E,), "i32")
        zero_counters(run(k, {"in:0": ids, "out:0": rows, "out:1": counts}, {"T": T, "B": 1}))
        check_grouping(rows.numpy(), counts.numpy(), ids.numpy(), E)


@pytest.mark.parametrize("phase", ["prefill", "mixed", "decode"])
@pytest.mark.parametrize("T,KT", [(1, 2), (37, 8)])
def test_moe_route_align(T, KT, phase):
    from .test_norm_kernels import router_logits
    gen = np.random.default_rng(T)
    logits = router_logits(T, E, gen, ties=[(KT - 1, KT), (0, 1)])
    k = render("moe_route", "moe_route_align", [("logits", ["T", E], "bf16")],
               [("w", ["T", KT], "f32"), ("ids", ["T", KT], "i32"), ("rows", [E, "T"], "i32"),
                ("counts", [E], "i32")], {"k": KT, "normalize": True, "experts": E}, phase=phase)
    w, ids = poison((T, KT), "f32"), poison((T, KT), "i32")
    rows, counts = poison((E, T), "i32"), poison((E,), "i32")
    zero_counters(run(k, {"in:0": logits, "out:0": w, "out:1": ids, "out:2": rows, "out:3": counts},
                      {"T": T, "B": T if phase == "decode" else 1}))
    w_ref, ids_ref, rows_ref, counts_ref = REGISTRY["moe_route_align"].reference(
        None, logits.float().numpy(), k=KT, normalize=True, experts=E)
    assert np.array_equal(ids.numpy(), ids_ref)
    assert np.allclose(w.numpy(), w_ref, rtol=1e-5, atol=1e-7)
    if phase == "decode":                    # decode routes only: the grouping is left alone
        assert (counts.numpy() == -7777).all() and (rows.numpy() == -7777).all()
    else:
        check_grouping(rows.numpy(), counts.numpy(), ids.numpy(), E)


def grouping(ids, E, gen):
    """moe_align's outputs as the kernel may leave them: each expert's list in a random order and
    the unused tail of the lists garbage."""
    rows, counts = REGISTRY["moe_align"].reference(None, ids.numpy(), experts=E)
    rows = rows.copy()
    for e in range(E):
        rows[e, :counts[e]] = gen.permutation(rows[e, :counts[e]])
        rows[e, counts[e]:] = 99999
    return torch.from_numpy(rows), torch.from_numpy(counts)


# (T, KT, ep, tune): blocks smaller than an expert's tokens (several row blocks per expert, a
# partial last one), GROUP_M orderings, column tiles that F and H do not fill, K loops that H=48
# and F=40 fill (BLOCK_K 16: unmasked) or not (32, 64: masked), gate_up's interleaved single dot
# (PAIR 1, the default) and its two dots (PAIR 0), moe_down's combine of the completed rows in
# chunks of COMBINE_ROWS (2: many chunks, the last one partial; the interpreter runs the programs
# in order, so the last expert's block completes nearly all of its rows)
GROUPED = [
    (1, 1, False, {"BLOCK_M": 16, "BLOCK_F": 16, "BLOCK_H": 16, "BLOCK_K": 16}),
    (1, 8, True, {"BLOCK_M": 16, "BLOCK_F": 32, "BLOCK_H": 32, "BLOCK_K": 32}),
    (3, 2, False, {"BLOCK_M": 16, "BLOCK_F": 16, "BLOCK_H": 16, "BLOCK_K": 32, "GROUP_M": 1}),
    (37, 8, False, {"BLOCK_M": 16, "BLOCK_F": 32, "BLOCK_H": 32, "BLOCK_K": 16, "GROUP_M": 4}),
    (37, 8, False, {"BLOCK_M": 16, "BLOCK_F": 16, "BLOCK_H": 16, "BLOCK_K": 16, "PAIR": 0,
                    "COMBINE_ROWS": 2}),
    (37, 8, True, {"BLOCK_M": 32, "BLOCK_F": 16, "BLOCK_H": 16, "BLOCK_K": 32, "GROUP_M": 2}),
    (37, 8, True, {"BLOCK_M": 32, "BLOCK_F": 32, "BLOCK_H": 64, "BLOCK_K": 16, "PAIR": 0,
                   "COMBINE_ROWS": 4}),
    (37, 2, False, {"BLOCK_M": 16, "BLOCK_F": 64, "BLOCK_H": 64, "BLOCK_K": 64}),
    (37, 1, True, {}),
    (37, 8, "dup", {"BLOCK_M": 32, "BLOCK_F": 16, "BLOCK_H": 16, "BLOCK_K": 32, "GROUP_M": 2}),
]


@pytest.mark.parametrize("T,KT,ep,tune", GROUPED)
def test_moe_gate_up_grouped(T, KT, ep, tune):
    gen = np.random.default_rng(T * 100 + KT + 1)
    ids, _ = routing(T, KT, E, gen, ep)
    rows, counts = grouping(ids, E, gen)
    x = rand((T, H), gen=gen)
    gu, _ = weights(E, H, F, gen)
    ins, outs = gate_up_inputs(KT)
    k = render("moe_gate_up_grouped", "moe_gate_up", ins, outs, phase="prefill",
               tune={k: v for k, v in tune.items() if k != "BLOCK_H"})
    act = poison((T, KT, F))
    run(k, {"in:0": x, "in:1": ids, "in:2": gu, "in:3": rows, "in:4": counts, "out:0": act}, {"T": T, "B": 1})
    want = REGISTRY["moe_gate_up"].reference(None, f32(x), ids.numpy(), f32(gu))
    assert rel_err(named(f32(act), ids), named(want, ids)) <= TOL
    assert_gated_order(act, x, ids, gu)
    # another order of the lists: the same bits
    rows2, _ = grouping(ids, E, gen)
    act2 = poison((T, KT, F))
    run(k, {"in:0": x, "in:1": ids, "in:2": gu, "in:3": rows2, "in:4": counts, "out:0": act2}, {"T": T, "B": 1})
    assert torch.equal(named(act, ids).view(torch.int16), named(act2, ids).view(torch.int16))


@pytest.mark.parametrize("T,KT,ep,tune", GROUPED)
def test_moe_down_grouped(T, KT, ep, tune):
    gen = np.random.default_rng(T * 100 + KT + 2)
    ids, rw = routing(T, KT, E, gen, ep)
    rows, counts = grouping(ids, E, gen)
    act = rand((T, KT, F), gen=gen, scale=0.5)
    _, down = weights(E, H, F, gen)
    ins, outs = down_inputs(KT)
    k = render("moe_down_grouped", "moe_down", ins, outs, phase="prefill",
               tune={k: v for k, v in tune.items() if k != "BLOCK_F"})
    y = poison((T, H))
    bindings = {"in:0": act, "in:1": rw, "in:2": ids, "in:3": down, "in:4": rows, "in:5": counts, "out:0": y}
    zero_counters(run(k, bindings, {"T": T, "B": 1}))
    want = REGISTRY["moe_down"].reference(None, f32(act), rw.numpy(), ids.numpy(), f32(down))
    assert rel_err(f32(y), want) <= TOL
    rows2, _ = grouping(ids, E, gen)
    y2 = poison((T, H))
    zero_counters(run(k, {**bindings, "in:4": rows2, "out:0": y2}, {"T": T, "B": 1}))
    assert torch.equal(y.view(torch.int16), y2.view(torch.int16))


# DeepSeek-V2 routing (ops/moe.py): group-limited top-k (groups / topk_groups) and the routed
# scaling factor, E not a power of two; (12, 3, 1, 5): k exceeds the kept group's 4 experts, so a
# dropped expert (p = 0, the lowest such id) fills the last slot with weight 0, as in transformers.
@pytest.mark.parametrize("T", [1, 5, 37])
@pytest.mark.parametrize("E_,groups,topk_groups,K,normalize,scale,group_score", [
    (16, 4, 2, 3, False, 1.0, None), (16, 4, 2, 3, True, 2.5, None), (12, 3, 2, 2, False, 16.0, None),
    (12, 3, 1, 5, False, 1.0, None), (12, 1, 1, 3, False, 0.7, None),
    # Mistral-Small-4's softmax groups, scored by their two best p
    (16, 4, 2, 3, True, 1.0, "top2"), (12, 3, 2, 2, False, 16.0, "top2"), (12, 3, 1, 5, False, 1.0, "top2")])
def test_moe_route_grouped(T, E_, groups, topk_groups, K, normalize, scale, group_score):
    from .test_norm_kernels import router_logits
    gen = np.random.default_rng(T * 31 + E_ + K)
    logits = router_logits(T, E_, gen, ties=[(0, 1), (K - 1, K)])
    attrs = {"k": K, "normalize": normalize, "groups": groups, "topk_groups": topk_groups, "scale": scale,
             **({"group_score": group_score} if group_score else {})}
    k = render("moe_route", "moe_route", [("logits", ["T", E_], "bf16")],
               [("w", ["T", K], "f32"), ("ids", ["T", K], "i32")], attrs)
    w, ids = poison((T, K), "f32"), poison((T, K), "i32")
    run(k, {"in:0": logits, "out:0": w, "out:1": ids}, {"T": T, "B": 1})
    w_ref, ids_ref = REGISTRY["moe_route"].reference(None, logits.float().numpy(), **attrs)
    assert np.array_equal(ids.numpy(), ids_ref)
    assert np.allclose(w.numpy(), w_ref, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_moe_route_align_grouped(phase):
    from .test_norm_kernels import router_logits
    T, E_, KT = 37, 16, 3
    logits = router_logits(T, E_, np.random.default_rng(5), ties=[(0, 1), (KT - 1, KT)])
    attrs = {"k": KT, "normalize": True, "experts": E_, "groups": 4, "topk_groups": 2, "scale": 2.5}
    k = render("moe_route", "moe_route_align", [("logits", ["T", E_], "bf16")],
               [("w", ["T", KT], "f32"), ("ids", ["T", KT], "i32"), ("rows", [E_, "T"], "i32"),
                ("counts", [E_], "i32")], attrs, phase=phase)
    w, ids = poison((T, KT), "f32"), poison((T, KT), "i32")
    rows, counts = poison((E_, T), "i32"), poison((E_,), "i32")
    zero_counters(run(k, {"in:0": logits, "out:0": w, "out:1": ids, "out:2": rows, "out:3": counts},
                      {"T": T, "B": T if phase == "decode" else 1}))
    w_ref, ids_ref, _, _ = REGISTRY["moe_route_align"].reference(None, logits.float().numpy(), **attrs)
    assert np.array_equal(ids.numpy(), ids_ref)
    assert np.allclose(w.numpy(), w_ref, rtol=1e-5, atol=1e-7)
    if phase != "decode":
        check_grouping(rows.numpy(), counts.numpy(), ids.numpy(), E_)


# DeepSeek-V3's router (ops/moe.py scoring "sigmoid" with its correction bias): a group scores
# its two best; (12, 3, 1, 5): k exceeds the kept group's 4 experts, so the lowest dropped id fills
# the last slot with its own p; (16, 1, 1, 4) Kimi-K2's single group; bias-free sigmoid too; and
# DeepSeek-V4's sqrt(softplus) scores where there are no groups (logits x 8: its threshold and tail).
@pytest.mark.parametrize("T", [1, 37])
@pytest.mark.parametrize("E_,groups,topk_groups,K,normalize,scale,biased,scoring", [
    c + (scoring,) for c in [(16, 4, 2, 3, True, 2.5, True), (24, 8, 3, 4, False, 1.0, True),
                             (12, 3, 1, 5, True, 1.0, True), (16, 1, 1, 4, True, 2.827, True),
                             (12, 3, 2, 2, True, 1.0, False)]
    for scoring in ("sigmoid", "sqrtsoftplus") if scoring == "sigmoid" or c[1] == 1])
def test_moe_route_sigmoid(T, E_, groups, topk_groups, K, normalize, scale, biased, scoring):
    from .test_norm_kernels import router_logits
    gen = np.random.default_rng(T * 17 + E_ + K)
    logits = router_logits(T, E_, gen, ties=[(0, 1)]) * (8 if scoring == "sqrtsoftplus" else 1)
    bias = torch.from_numpy((gen.standard_normal(E_) * 0.5).astype(np.float32))
    attrs = {"k": K, "normalize": normalize, "groups": groups, "topk_groups": topk_groups, "scale": scale,
             "scoring": scoring, **({"has_bias": True} if biased else {})}
    ins = [("logits", ["T", E_], "bf16")] + ([("bias", [E_], "f32")] if biased else [])
    k = render("moe_route", "moe_route", ins, [("w", ["T", K], "f32"), ("ids", ["T", K], "i32")], attrs)
    w, ids = poison((T, K), "f32"), poison((T, K), "i32")
    run(k, {"in:0": logits, **({"in:1": bias} if biased else {}), "out:0": w, "out:1": ids}, {"T": T, "B": 1})
    extra = (bias.numpy(),) if biased else ()
    w_ref, ids_ref = REGISTRY["moe_route"].reference(None, logits.float().numpy(), *extra, **attrs)
    assert np.array_equal(ids.numpy(), ids_ref)
    assert np.allclose(w.numpy(), w_ref, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_moe_route_align_sigmoid(phase):
    from .test_norm_kernels import router_logits
    T, E_, KT = 37, 16, 3
    gen = np.random.default_rng(6)
    logits = router_logits(T, E_, gen, ties=[(0, 1)])
    bias = torch.from_numpy((gen.standard_normal(E_) * 0.5).astype(np.float32))
    attrs = {"k": KT, "normalize": True, "experts": E_, "groups": 4, "topk_groups": 2, "scale": 2.5,
             "scoring": "sigmoid", "has_bias": True}
    k = render("moe_route", "moe_route_align", [("logits", ["T", E_], "bf16"), ("bias", [E_], "f32")],
               [("w", ["T", KT], "f32"), ("ids", ["T", KT], "i32"), ("rows", [E_, "T"], "i32"),
                ("counts", [E_], "i32")], attrs, phase=phase)
    w, ids = poison((T, KT), "f32"), poison((T, KT), "i32")
    rows, counts = poison((E_, T), "i32"), poison((E_,), "i32")
    zero_counters(run(k, {"in:0": logits, "in:1": bias, "out:0": w, "out:1": ids, "out:2": rows, "out:3": counts},
                      {"T": T, "B": T if phase == "decode" else 1}))
    w_ref, ids_ref, _, _ = REGISTRY["moe_route_align"].reference(None, logits.float().numpy(), bias.numpy(), **attrs)
    assert np.array_equal(ids.numpy(), ids_ref)
    assert np.allclose(w.numpy(), w_ref, rtol=1e-5, atol=1e-7)
    if phase != "decode":
        check_grouping(rows.numpy(), counts.numpy(), ids.numpy(), E_)


def test_moe_route_default_attrs_render_unchanged():
    """groups=1, topk_groups=1, scale=1.0, shared=0 given explicitly render the kernel of no attrs."""
    ins, outs = [("logits", ["T", 10], "bf16")], [("w", ["T", 2], "f32"), ("ids", ["T", 2], "i32")]
    base = {"k": 2, "normalize": True}
    assert render("moe_route", "moe_route", ins, outs, base).source == \
        render("moe_route", "moe_route", ins, outs,
               {**base, "groups": 1, "topk_groups": 1, "scale": 1.0, "shared": 0, "scoring": "softmax"}).source


# fold_shared_experts: the router appends the always-on experts E .. E+S-1 at weight 1; with the
# grouping (prefill) they join every token's lists. K + S = 8 fills BLOCK_K exactly (6 + 2, as
# DeepSeek-V2-Lite), 3 + 2 leaves padding lanes.
@pytest.mark.parametrize("phase", ["prefill", "decode"])
@pytest.mark.parametrize("T,K,S,normalize,scale", [(1, 6, 2, False, 1.0), (37, 6, 2, False, 16.0),
                                                   (5, 3, 2, True, 2.5), (9, 2, 1, False, 1.0)])
def test_moe_route_shared(phase, T, K, S, normalize, scale):
    from .test_norm_kernels import router_logits
    E_ = 16
    logits = router_logits(T, E_, np.random.default_rng(T + K), ties=[(0, 1), (K - 1, K)])
    attrs = {"k": K, "normalize": normalize, "experts": E_ + S, "groups": 4, "topk_groups": 2,
             "scale": scale, "shared": S}
    KS = K + S
    k = render("moe_route", "moe_route_align", [("logits", ["T", E_], "bf16")],
               [("w", ["T", KS], "f32"), ("ids", ["T", KS], "i32"), ("rows", [E_ + S, "T"], "i32"),
                ("counts", [E_ + S], "i32")], attrs, phase=phase)
    w, ids = poison((T, KS), "f32"), poison((T, KS), "i32")
    rows, counts = poison((E_ + S, T), "i32"), poison((E_ + S,), "i32")
    zero_counters(run(k, {"in:0": logits, "out:0": w, "out:1": ids, "out:2": rows, "out:3": counts},
                      {"T": T, "B": T if phase == "decode" else 1}))
    w_ref, ids_ref, _, _ = REGISTRY["moe_route_align"].reference(None, logits.float().numpy(), **attrs)
    assert (ids_ref[:, K:] == np.arange(E_, E_ + S)).all() and (w_ref[:, K:] == 1).all()
    assert np.array_equal(ids.numpy(), ids_ref)
    assert np.allclose(w.numpy(), w_ref, rtol=1e-5, atol=1e-7)
    if phase != "decode":
        check_grouping(rows.numpy(), counts.numpy(), ids.numpy(), E_ + S)
        assert (counts.numpy()[E_:] == T).all()


def skewed_routing(T, KT, E, hot, gen):
    """Every token chooses KT distinct experts among the few `hot` ones: the others get no token
    (no row block at all), the hot ones several blocks each, with a partial last one."""
    ids = np.stack([gen.choice(hot, size=KT, replace=False) for _ in range(T)]).astype(np.int32)
    w = (gen.random((T, KT)) + 0.1).astype(np.float32)
    return torch.from_numpy(ids), torch.from_numpy(w)


# (T, KT, hot experts, tune): 3 or 4 of 10 experts take all tokens (the others have none), T not a
# multiple of any tile; the tiles are smaller than a hot expert's tokens. HALF_TAIL (the default
# from BLOCK_M 32 up): ~40 tokens an expert in blocks of 32 leave tails of <= 16 rows, which run the
# half-height tile, and (75, 2) tails of more, which run the full one
SKEWED = [
    (70, 2, [2, 5, 7], {"BLOCK_M": 16, "BLOCK_F": 16, "BLOCK_H": 32, "BLOCK_K": 16, "COMBINE_ROWS": 8}),
    (53, 3, [0, 4, 6, 9], {"BLOCK_M": 16, "BLOCK_F": 32, "BLOCK_H": 16, "BLOCK_K": 32, "PAIR": 0, "GROUP_M": 2}),
    (60, 2, [1, 3, 8], {"BLOCK_M": 32, "BLOCK_F": 16, "BLOCK_H": 16, "BLOCK_K": 16, "COMBINE_ROWS": 4}),
    (75, 2, [1, 3, 8], {"BLOCK_M": 32, "BLOCK_F": 32, "BLOCK_H": 32, "BLOCK_K": 32, "PAIR": 0}),
]


@pytest.mark.parametrize("T,KT,hot,tune", SKEWED)
def test_moe_grouped_skewed_routing(T, KT, hot, tune):
    """gate_up then down on their own outputs, as the plan runs them, when most experts are idle
    and the hot ones span several row blocks."""
    gen = np.random.default_rng(T + KT)
    ids, rw = skewed_routing(T, KT, E, hot, gen)
    rows, counts = grouping(ids, E, gen)
    c = counts.numpy()
    assert (c == 0).sum() == E - len(hot) and c.max() > tune["BLOCK_M"]
    x = rand((T, H), gen=gen)
    gu, down = weights(E, H, F, gen)
    ins, outs = gate_up_inputs(KT)
    kg = render("moe_gate_up_grouped", "moe_gate_up", ins, outs, phase="prefill", tune=tune)
    act = poison((T, KT, F))
    run(kg, {"in:0": x, "in:1": ids, "in:2": gu, "in:3": rows, "in:4": counts, "out:0": act}, {"T": T, "B": 1})
    want = REGISTRY["moe_gate_up"].reference(None, f32(x), ids.numpy(), f32(gu))
    assert rel_err(f32(act), want) <= TOL
    ins, outs = down_inputs(KT)
    kd = render("moe_down_grouped", "moe_down", ins, outs, phase="prefill", tune=tune)
    y = poison((T, H))
    bindings = {"in:0": act, "in:1": rw, "in:2": ids, "in:3": down, "in:4": rows, "in:5": counts, "out:0": y}
    zero_counters(run(kd, bindings, {"T": T, "B": 1}))
    want = REGISTRY["moe_down"].reference(None, f32(act), rw.numpy(), ids.numpy(), f32(down))
    assert rel_err(f32(y), want) <= TOL
    rows2, _ = grouping(ids, E, gen)
    y2 = poison((T, H))
    zero_counters(run(kd, {**bindings, "in:4": rows2, "out:0": y2}, {"T": T, "B": 1}))
    assert torch.equal(y.view(torch.int16), y2.view(torch.int16))


def test_moe_grouped_defaults_at_qwen3_30b_shapes():
    """The defaults the build renders at qwen3-30b-a3b's shapes (H=2048, F=768, 128 experts, top-8):
    unmasked K loops, gate_up's interleaved single dot, moe_down's 128 x 256 tiles; and the
    grids' bound on the row blocks covers the worst case (every expert's last block partial)."""
    from infc.compiler.contract.bind import grid
    Hq, Fq, Eq, KTq = 2048, 768, 128, 8
    gu = render("moe_gate_up_grouped", "moe_gate_up",
                [("x", ["T", Hq], "bf16"), ("ids", ["T", KTq], "i32"), ("gate_up", [Eq, 2 * Fq, Hq], "bf16", "weight"),
                 ("rows", [Eq, "T"], "i32"), ("counts", [Eq], "i32")], [("act", ["T", KTq, Fq], "bf16")],
                phase="prefill")
    dn = render("moe_down_grouped", "moe_down",
                [("act", ["T", KTq, Fq], "bf16"), ("weights", ["T", KTq], "f32"), ("ids", ["T", KTq], "i32"),
                 ("down", [Eq, Hq, Fq], "bf16", "weight"), ("rows", [Eq, "T"], "i32"), ("counts", [Eq], "i32")],
                [("y", ["T", Hq], "bf16")], phase="prefill")
    c = gu.meta["constexprs"]
    assert (c["BLOCK_M"], c["BLOCK_F"], c["BLOCK_K"], c["PAIR"], c["EVEN_K"]) == (128, 128, 64, 1, True)
    c = dn.meta["constexprs"]
    assert (c["BLOCK_M"], c["BLOCK_H"], c["BLOCK_K"], c["EVEN_K"], c["NB"]) == (128, 256, 64, True, 8)
    for T in (1, 5, 1024, 8191):
        # the tokens' KT * T slots over the experts: sum_e cdiv(n_e, 128) <= T * KT / 128 + the
        # number of experts with a token, which the grid's bound covers
        for k, tiles in ((gu, Fq // 128), (dn, Hq // 256)):
            blocks, rem = divmod(grid(k.meta, {"T": T, "B": 1})[0], tiles)
            assert rem == 0 and blocks == -(-T * KTq // 128) + min(Eq, T * KTq), (T, blocks)


def test_moe_route_sqrtsoftplus_tail():
    """Every logit far below zero (softplus ~ e^x, ~1e-6 .. 1e-4): the chosen experts' scores are
    all tail, where log(1 + u) in fp32 would keep a few digits of u; the weights still match."""
    from .test_norm_kernels import router_logits
    T, E_, K = 9, 16, 4
    logits = (router_logits(T, E_, np.random.default_rng(3), ties=[]).float() * 2 - 12).to(torch.bfloat16)
    attrs = {"k": K, "normalize": True, "scoring": "sqrtsoftplus"}
    k = render("moe_route", "moe_route", [("logits", ["T", E_], "bf16")],
               [("w", ["T", K], "f32"), ("ids", ["T", K], "i32")], attrs)
    w, ids = poison((T, K), "f32"), poison((T, K), "i32")
    run(k, {"in:0": logits, "out:0": w, "out:1": ids}, {"T": T, "B": 1})
    w_ref, ids_ref = REGISTRY["moe_route"].reference(None, logits.float().numpy(), **attrs)
    assert logits.float().max() < -5
    assert np.array_equal(ids.numpy(), ids_ref)
    assert np.allclose(w.numpy(), w_ref, rtol=1e-5, atol=1e-7)


# the renormalization's divisor max(sum + norm_eps, norm_min): ERNIE-4.5's floor (0.9 bites on
# most rows of a top-3 softmax over 12) and LFM2-MoE's + 1e-6 under its sigmoid scores
@pytest.mark.parametrize("scoring,norm_eps,norm_min", [("softmax", 0.0, 0.9), ("sigmoid", 1e-6, 0.0),
                                                       ("softmax", 0.05, 0.5)])
def test_moe_route_norm_floor_and_eps(scoring, norm_eps, norm_min):
    from .test_norm_kernels import router_logits
    T, E_, K = 37, 12, 3
    logits = router_logits(T, E_, np.random.default_rng(9), ties=[(0, 1)])
    attrs = {"k": K, "normalize": True, "scoring": scoring, "norm_eps": norm_eps, "norm_min": norm_min}
    k = render("moe_route", "moe_route", [("logits", ["T", E_], "bf16")],
               [("w", ["T", K], "f32"), ("ids", ["T", K], "i32")], attrs)
    w, ids = poison((T, K), "f32"), poison((T, K), "i32")
    run(k, {"in:0": logits, "out:0": w, "out:1": ids}, {"T": T, "B": 1})
    w_ref, ids_ref = REGISTRY["moe_route"].reference(None, logits.float().numpy(), **attrs)
    assert np.array_equal(ids.numpy(), ids_ref)
    assert np.allclose(w.numpy(), w_ref, rtol=1e-5, atol=1e-7)
    plain, _ = REGISTRY["moe_route"].reference(None, logits.float().numpy(), k=K, normalize=True, scoring=scoring)
    assert not np.allclose(w_ref, plain, rtol=1e-7, atol=0)      # the divisor is not the sum
