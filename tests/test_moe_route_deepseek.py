"""moe_route's DeepSeek-V2 routing (groups / topk_groups / scale) against transformers' own
router, DeepseekV2TopkRouter, on random logits (no ties: torch.topk(sorted=False) promises no
order among equal scores, moe_route takes the lower id): the same experts per token (as sets)
and the same weights to 1e-6. Also: the defaults leave the op as it was, and a spec's keyword
attrs reach the node."""
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
    assert op.extra_attrs == {"groups": 1, "topk_groups": 1, "scale": 1.0, "shared": 0}
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


@pytest.mark.parametrize("extra,want", [("", {}),
                                        (", groups=4, topk_groups=2, scale=2.5",
                                         {"groups": 4, "topk_groups": 2, "scale": 2.5})])
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
