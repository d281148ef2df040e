"""moe_route's DeepSeek routing against transformers' own routers on random logits (no ties:
torch.topk(sorted=False) promises no order among equal scores, moe_route takes the lower id): the
same experts per token (as sets) and the same weights to 1e-6. DeepSeek-V2's (softmax; groups /
topk_groups / scale) against DeepseekV2TopkRouter; DeepSeek-V3's noaux_tc (scoring sigmoid, the
e_score_correction_bias choosing, a group scored by its two best, normalize, scale) against
DeepseekV3TopkRouter. Also: the defaults leave the op as it was, and a spec's keyword attrs and
bias tensor reach the node."""
import numpy as np
import pytest
import torch

from infc.compiler.ops import REGISTRY

ROUTE = REGISTRY["moe_route"].reference


def hf_route(logits, k, method, groups, topk_groups, scale):
    """transformers' router with weight = identity, so its router logits are `logits`."""
    from transformers.models.deepseek_v2.configuration_deepseek_v2 import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    T, E = logits.shape
    cfg = DeepseekV2Config(hidden_size=E, n_routed_experts=E, num_experts_per_tok=k, topk_method=method,
                           n_group=groups, topk_group=topk_groups, routed_scaling_factor=scale,
                           num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                           vocab_size=32, intermediate_size=8, moe_intermediate_size=8)
    gate = DeepseekV2TopkRouter(cfg)
    with torch.no_grad():
        gate.weight.copy_(torch.eye(E))
        got_logits, w, ids = gate(torch.from_numpy(logits))
    assert torch.equal(got_logits, torch.from_numpy(logits))
    return w.numpy(), ids.numpy()


CASES = [  # (T, E, k, method, groups, topk_groups, scale)
    (5, 16, 3, "greedy", None, None, 1.0),
    (7, 12, 2, "greedy", None, None, 16.0),
    (9, 16, 3, "group_limited_greedy", 4, 2, 1.0),
    (9, 16, 3, "group_limited_greedy", 4, 2, 2.5),
    (11, 12, 4, "group_limited_greedy", 3, 1, 1.0),   # k = the kept group's 4 experts
    (11, 12, 2, "group_limited_greedy", 3, 2, 0.7),
    (6, 160, 6, "group_limited_greedy", 8, 3, 16.0),  # DeepSeek-V2's shape
]


@pytest.mark.parametrize("T,E,k,method,groups,topk_groups,scale", CASES)
def test_route_matches_hf(T, E, k, method, groups, topk_groups, scale):
    gen = np.random.default_rng(T * E + k)
    logits = (gen.standard_normal((T, E)) * 2).astype(np.float32)
    w_hf, ids_hf = hf_route(logits, k, method, groups, topk_groups, scale)
    g = groups if method == "group_limited_greedy" else 1         # greedy ignores n_group
    w, ids = ROUTE(None, logits, k=k, normalize=False, groups=g, topk_groups=topk_groups if g > 1 else 1,
                   scale=scale)
    assert w.dtype == np.float32 and ids.dtype == np.int32
    for t in range(T):
        assert set(ids[t].tolist()) == set(ids_hf[t].tolist()), t
        order = np.argsort(ids[t]), np.argsort(ids_hf[t])
        assert np.allclose(w[t][order[0]], w_hf[t][order[1]], rtol=0, atol=1e-6), t
    if g > 1:   # every chosen expert lies in a kept group
        gs = E // g
        best = logits.reshape(T, g, gs).max(-1)
        kept = np.argsort(-best, axis=-1)[:, :topk_groups]
        assert all(set((ids[t] // gs).tolist()) <= set(kept[t].tolist()) for t in range(T))


def hf_route_v3(logits, bias, k, groups, topk_groups, scale, normalize):
    """transformers' DeepseekV3TopkRouter with weight = identity and the given correction bias."""
    from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    T, E = logits.shape
    cfg = DeepseekV3Config(hidden_size=E, n_routed_experts=E, num_experts_per_tok=k, n_group=groups,
                           topk_group=topk_groups, routed_scaling_factor=scale, norm_topk_prob=normalize,
                           num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                           vocab_size=32, intermediate_size=8, moe_intermediate_size=8)
    gate = DeepseekV3TopkRouter(cfg)
    with torch.no_grad():
        gate.weight.copy_(torch.eye(E))
        gate.e_score_correction_bias.copy_(torch.from_numpy(bias))
        _, w, ids = gate(torch.from_numpy(logits))
    return w.numpy(), ids.numpy()


V3_CASES = [  # (T, E, k, groups, topk_groups, scale, normalize)
    (7, 16, 3, 1, 1, 1.0, True),
    (9, 16, 3, 4, 2, 2.5, True),
    (9, 24, 4, 8, 3, 2.5, False),
    (11, 12, 4, 3, 1, 1.0, True),       # k = the kept group's 4 experts
    (6, 256, 8, 8, 4, 2.5, True),       # DeepSeek-V3's shape
    (5, 384, 8, 1, 1, 2.827, True),     # Kimi-K2's (one group)
]


@pytest.mark.parametrize("T,E,k,groups,topk_groups,scale,normalize", V3_CASES)
def test_route_sigmoid_matches_hf_v3(T, E, k, groups, topk_groups, scale, normalize):
    gen = np.random.default_rng(T * E + k + 1)
    logits = (gen.standard_normal((T, E)) * 2).astype(np.float32)
    bias = (gen.standard_normal(E) * 0.5).astype(np.float32)     # large enough to change choices
    w_hf, ids_hf = hf_route_v3(logits, bias, k, groups, topk_groups, scale, normalize)
    w, ids = ROUTE(None, logits, bias, k=k, normalize=normalize, groups=groups, topk_groups=topk_groups,
                   scale=scale, scoring="sigmoid", has_bias=True)
    for t in range(T):
        assert set(ids[t].tolist()) == set(ids_hf[t].tolist()), t
        order = np.argsort(ids[t]), np.argsort(ids_hf[t])
        assert np.allclose(w[t][order[0]], w_hf[t][order[1]], rtol=1e-6, atol=1e-6), t
    # the bias chose: without it, some token picks other experts
    _, ids0 = ROUTE(None, logits, k=k, normalize=normalize, groups=groups, topk_groups=topk_groups,
                    scale=scale, scoring="sigmoid")
    assert any(set(ids0[t].tolist()) != set(ids[t].tolist()) for t in range(T))


@pytest.mark.parametrize("T,E,k,scale", [(7, 16, 3, 1.0), (5, 256, 6, 1.5)])
def test_route_sqrtsoftplus_matches_deepseek_v4(T, E, k, scale):
    """DeepSeek-V4's router (transformers' DeepseekV4TopKRouter, written out: its config needs a
    whole model's fields): s = sqrt(softplus(logits)), top-k of s + bias, weights s renormalized
    (+ 1e-20) times the scale; logits from -30 to 30 (softplus's threshold and its small tail)."""
    gen = np.random.default_rng(T + E)
    logits = (gen.standard_normal((T, E)) * 10).astype(np.float32)
    bias = (gen.standard_normal(E) * 0.3).astype(np.float32)
    s = torch.nn.functional.softplus(torch.from_numpy(logits)).sqrt()
    ids_hf = torch.topk(s + torch.from_numpy(bias), k, dim=-1).indices
    w_hf = s.gather(1, ids_hf)
    w_hf = (w_hf / (w_hf.sum(-1, keepdim=True) + 1e-20) * scale).numpy()
    w, ids = ROUTE(None, logits, bias, k=k, normalize=True, scale=scale, scoring="sqrtsoftplus", has_bias=True)
    assert np.array_equal(ids, ids_hf.numpy().astype(np.int32))
    np.testing.assert_allclose(w, w_hf, rtol=1e-6, atol=1e-7)
    tiny = np.array([[-30.0, -12.0, 25.0]], np.float32)      # the tail keeps its digits
    w, _ = ROUTE(None, tiny, k=3, scoring="sqrtsoftplus")
    want = torch.nn.functional.softplus(torch.from_numpy(tiny).double()).sqrt().numpy()
    np.testing.assert_allclose(np.sort(w[0]), np.sort(want[0]), rtol=1e-6)


def test_defaults_unchanged():
    gen = np.random.default_rng(0)
    logits = gen.standard_normal((5, 10)).astype(np.float32)
    for norm in (False, True):
        w0, i0 = ROUTE(None, logits, k=3, normalize=norm)
        w1, i1 = ROUTE(None, logits, k=3, normalize=norm, groups=1, topk_groups=1, scale=1.0)
        assert np.array_equal(i0, i1) and np.array_equal(w0.view(np.int32), w1.view(np.int32))


def test_group_ties_lower_id():
    """Tied group scores keep the lower group; tied experts the lower id."""
    l = np.full((1, 8), -4.0, np.float32)
    l[0, [1, 3, 5]] = 2.0                # groups of 2: groups 0, 1, 2 tie at their max
    w, ids = ROUTE(None, l, k=2, groups=4, topk_groups=2)
    assert ids[0].tolist() == [1, 3]


@pytest.mark.parametrize("normalize,scale", [(False, 1.0), (True, 2.5), (False, 16.0)])
def test_shared_slots_follow_the_routed_ones(normalize, scale):
    """shared = n (fold_shared_experts): the routed slots as without it, then experts E .. E+n-1
    at weight 1 exactly, whatever the normalization and scale."""
    l = np.random.default_rng(2).standard_normal((5, 12)).astype(np.float32)
    w0, i0 = ROUTE(None, l, k=3, normalize=normalize, scale=scale, groups=4, topk_groups=2)
    w, ids = ROUTE(None, l, k=3, normalize=normalize, scale=scale, groups=4, topk_groups=2, shared=2)
    assert w.shape == ids.shape == (5, 5) and ids.dtype == np.int32 and ids.flags.c_contiguous
    assert np.array_equal(ids[:, :3], i0) and np.array_equal(w[:, :3], w0)
    assert (ids[:, 3:] == [12, 13]).all() and (w[:, 3:] == 1.0).all()


def test_normalize_then_scale():
    l = np.random.default_rng(1).standard_normal((3, 8)).astype(np.float32)
    w, _ = ROUTE(None, l, k=2, normalize=True, scale=2.0)
    assert np.allclose(w.sum(-1), 2.0, atol=1e-6)


def test_spec_keyword_attrs():
    """groups / topk_groups / scale parse as keywords from a spec and land in the node's attrs
    (and infer checks them); without them the node carries only k and normalize."""
    from infc.compiler.ops.base import ShapeError
    from infc.compiler.ops.moe import route_infer
    from infc.compiler.ir import TensorType
    op = REGISTRY["moe_route"]
    assert op.extra_attrs == {"groups": 1, "topk_groups": 1, "scale": 1.0, "shared": 0, "scoring": "softmax",
                              "group_score": "max", "norm_eps": 0.0, "norm_min": 0.0}
    assert op.keyword_optional == ["bias"]
    lt = TensorType((4, 12), "f32")
    route_infer([lt], {"k": 2, "groups": 3, "topk_groups": 2, "scale": 16.0})
    w, ids = route_infer([lt], {"k": 2, "shared": 3})
    assert w.shape == ids.shape == (4, 5)
    for bad in (-1, 1.5, True):
        with pytest.raises(ShapeError):
            route_infer([lt], {"k": 2, "shared": bad})
    with pytest.raises(ShapeError):
        route_infer([lt], {"k": 2, "groups": 5})
    with pytest.raises(ShapeError):
        route_infer([lt], {"k": 2, "groups": 3, "topk_groups": 4})
    with pytest.raises(ShapeError, match="scoring"):
        route_infer([lt], {"k": 2, "scoring": "relu"})
    with pytest.raises(ShapeError, match="bias"):
        route_infer([lt, TensorType((11,), "f32")], {"k": 2, "scoring": "sigmoid"})
    with pytest.raises(ShapeError, match="sqrtsoftplus"):
        route_infer([lt], {"k": 2, "scoring": "sqrtsoftplus", "groups": 3})
    with pytest.raises(ShapeError, match="two best"):
        route_infer([lt], {"k": 2, "scoring": "sigmoid", "groups": 12})


@pytest.mark.parametrize("extra,want", [("", {}),
                                        (", groups=4, topk_groups=2, scale=2.5",
                                         {"groups": 4, "topk_groups": 2, "scale": 2.5}),
                                        (", scoring='sigmoid', bias=router",
                                         {"scoring": "sigmoid", "has_bias": True})])
def test_spec_attrs_reach_the_node(tmp_path, extra, want):
    """qwen3_moe's spec with the keywords added to its moe_route call: they land in the node's
    attrs; without them the node carries only k and normalize (so plans stay as they were)."""
    from pathlib import Path
    from infc.compiler.lower import lower
    from infc.compiler.spec import load_spec
    src = (Path(__file__).resolve().parents[1] / "specs" / "qwen3_moe.yaml").read_text()
    call = "moe_route(linear(h, router), K, norm_topk)"
    assert src.count(call) == 1
    f = tmp_path / "qwen3_moe.yaml"
    f.write_text(src.replace(call, call[:-1] + extra + ")"))
    spec = load_spec(f)
    cfg = dict(spec.variants["qwen3-30b-a3b"], num_hidden_layers=2, num_experts=16)
    g, _ = lower(spec, spec.bind(cfg))
    nodes = [n for sub in g.walk() for n in sub.ordered() if n.op == "moe_route"]
    assert nodes
    for n in nodes:
        assert n.attrs == {"k": 8, "normalize": True, **want}


def hf_route_mistral4(logits, k, groups, topk_groups, scale, normalize):
    """transformers' Mistral4TopkRouter (softmax scores, a group scored by its two best) with
    weight = identity."""
    from transformers.models.mistral4.configuration_mistral4 import Mistral4Config
    from transformers.models.mistral4.modeling_mistral4 import Mistral4TopkRouter
    T, E = logits.shape
    cfg = Mistral4Config(hidden_size=E, n_routed_experts=E, num_experts_per_tok=k, n_group=groups,
                         topk_group=topk_groups, routed_scaling_factor=scale, norm_topk_prob=normalize,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                         vocab_size=32, intermediate_size=8, moe_intermediate_size=8)
    gate = Mistral4TopkRouter(cfg)
    with torch.no_grad():
        gate.weight.copy_(torch.eye(E))
        _, w, ids = gate(torch.from_numpy(logits))
    return w.numpy(), ids.numpy()


@pytest.mark.parametrize("T,E,k,groups,topk_groups,scale,normalize", [
    (9, 16, 3, 4, 2, 1.0, True), (13, 24, 4, 8, 2, 2.5, False), (7, 16, 2, 1, 1, 1.0, True),
    (6, 128, 4, 8, 2, 1.0, True)])
def test_route_softmax_top2_groups_matches_hf_mistral4(T, E, k, groups, topk_groups, scale, normalize):
    gen = np.random.default_rng(T * E + k + 2)
    logits = (gen.standard_normal((T, E)) * 2).astype(np.float32)
    w_hf, ids_hf = hf_route_mistral4(logits, k, groups, topk_groups, scale, normalize)
    extra = {"group_score": "top2"} if groups > 1 else {}
    w, ids = ROUTE(None, logits, k=k, normalize=normalize, groups=groups, topk_groups=topk_groups,
                   scale=scale, **extra)
    for t in range(T):
        assert set(ids[t].tolist()) == set(ids_hf[t].tolist()), t
        order = np.argsort(ids[t]), np.argsort(ids_hf[t])
        assert np.allclose(w[t][order[0]], w_hf[t][order[1]], rtol=1e-6, atol=1e-6), t
    if groups > 1:     # scoring groups by their best instead chooses other experts somewhere
        _, ids_max = ROUTE(None, logits, k=k, normalize=normalize, groups=groups, topk_groups=topk_groups,
                           scale=scale)
        assert any(set(ids_max[t].tolist()) != set(ids[t].tolist()) for t in range(T))


@pytest.mark.parametrize("attrs,needle", [
    ({"group_score": "sum"}, "group_score must be"),
    ({"group_score": "top2"}, "applies to softmax scores in groups"),
    ({"group_score": "top2", "groups": 4, "topk_groups": 2, "scoring": "sigmoid"}, "applies to softmax"),
])
def test_group_score_misuse_is_refused(attrs, needle):
    from infc.compiler.ir import TensorType
    from infc.compiler.ops.base import ShapeError
    with pytest.raises(ShapeError, match=needle):
        REGISTRY["moe_route"].infer([TensorType(("T", 16), "bf16")], {"k": 2, **attrs})
