"""DeepSeek-V4's non-attention ops (compiler/ops/hyper_connection.py, the hash router's scores in
ops/moe_table.py, the clamped SwiGLU in ops/gated_act.py): each reference, composed as a spec
writes it, against the transformers module it stands for (random float32 weights, atol 1e-5);
their shape rules' errors."""
import numpy as np
import pytest
import torch

from infc.compiler.ir import TensorType
from infc.compiler.ops import REGISTRY, ShapeError

N, H, T = 4, 24, 7          # hc_mult streams of width H; T tokens (B = 1)


def _cfg(**over):
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config
    kw = dict(hidden_size=H, intermediate_size=20, moe_intermediate_size=20, num_hidden_layers=1,
              num_attention_heads=2, num_key_value_heads=1, vocab_size=50, hc_mult=N, hc_sinkhorn_iters=5,
              hc_eps=1e-6, rms_norm_eps=1e-6, swiglu_limit=0.7, n_routed_experts=6, num_experts_per_tok=2,
              routed_scaling_factor=1.5)
    kw.update(over)
    return DeepseekV4Config(**kw)


def ref(name, *args, **attrs):
    return REGISTRY[name].reference(None, *args, **attrs)


def _randomize(module, gen, scale=1.0):
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.from_numpy((gen.standard_normal(tuple(p.shape)) * scale).astype(np.float32)))


def _mix(x, fn, eps):
    """mix = linear(rms_norm(view(x, [T, N * H]), eps=eps), fn), through the ops' references."""
    flat = x.reshape(x.shape[0], -1)
    return ref("linear", ref("rms_norm", flat, eps=eps, has_weight=False), fn)


def test_hyper_connection_vs_hf():
    """pre / post / comb and the collapsed sublayer input of DeepseekV4HyperConnection, then the
    layer's post-mix (DeepseekV4DecoderLayer's post * out + comb^T @ streams)."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection
    gen = np.random.default_rng(0)
    hc = DeepseekV4HyperConnection(_cfg()).float()
    _randomize(hc, gen, 0.3)
    streams = torch.from_numpy(gen.standard_normal((1, T, N, H)).astype(np.float32))
    with torch.no_grad():
        post, comb, collapsed = hc(streams)
    x = streams[0].numpy()
    mix = _mix(x, hc.fn.detach().numpy(), 1e-6)
    np.testing.assert_allclose(ref("hc_mix", x, hc.fn.detach().numpy(), eps=1e-6), mix, rtol=1e-5, atol=1e-5)
    pre, got_post, got_comb = ref("hc_weights", mix, hc.base.detach().numpy(), hc.scale.detach().numpy(),
                                  iters=5, eps=1e-6)
    np.testing.assert_allclose(got_post, post[0].numpy(), rtol=0, atol=1e-5)
    np.testing.assert_allclose(got_comb, comb[0].numpy(), rtol=0, atol=1e-5)
    np.testing.assert_allclose(ref("hc_collapse", x, pre), collapsed[0].numpy(), rtol=0, atol=1e-5)
    # the Sinkhorn projection did something: comb's rows and columns sum to ~1, the softmax's only rows
    assert np.abs(got_comb.sum(-2) - 1).max() < 1e-3 and np.abs(got_comb.sum(-1) - 1).max() < 1e-2
    y = gen.standard_normal((T, H)).astype(np.float32)
    want = post[0, :, :, None] * torch.from_numpy(y)[:, None, :] + torch.matmul(comb[0].transpose(-1, -2), streams[0])
    np.testing.assert_allclose(ref("hc_expand", y, x, got_post, got_comb), want.numpy(), rtol=0, atol=1e-5)


def test_hyper_head_and_streams_vs_hf():
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperHead
    gen = np.random.default_rng(1)
    head = DeepseekV4HyperHead(_cfg()).float()
    _randomize(head, gen, 0.3)
    streams = torch.from_numpy(gen.standard_normal((1, T, N, H)).astype(np.float32))
    with torch.no_grad():
        want = head(streams)[0].numpy()
    x = streams[0].numpy()
    pre = ref("hc_head_weights", ref("hc_mix", x, head.hc_fn.detach().numpy(), eps=1e-6), head.hc_base.detach().numpy(),
              head.hc_scale.detach().numpy(), eps=1e-6)
    np.testing.assert_allclose(ref("hc_collapse", x, pre), want, rtol=0, atol=1e-5)
    e = x[:, 0]
    # DeepseekV4Model's first residual: the embedding expanded to hc_mult streams
    np.testing.assert_array_equal(ref("hc_streams", e, n=N), torch.from_numpy(e).unsqueeze(1).expand(-1, N, -1).numpy())


def test_mlp_and_experts_clamped_swiglu_vs_hf():
    """The shared expert (DeepseekV4MLP) as the spec writes it, mul(silu(clamp(g, max=l)),
    clamp(u, -l, l)), and the routed experts' act="clamped_silu" (DeepseekV4Experts._apply_gate)."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Experts, DeepseekV4MLP
    gen = np.random.default_rng(2)
    cfg, lim = _cfg(), 0.7
    mlp = DeepseekV4MLP(cfg).float()
    _randomize(mlp, gen)
    x = gen.standard_normal((T, H)).astype(np.float32)
    with torch.no_grad():
        want = mlp(torch.from_numpy(x)).numpy()
    g = ref("linear", x, mlp.gate_proj.weight.detach().numpy())
    u = ref("linear", x, mlp.up_proj.weight.detach().numpy())
    assert (g > lim).any() and (np.abs(u) > lim).any()      # both clamps bite
    h = ref("mul", ref("silu", ref("clamp", g, max=lim)), ref("clamp", u, min=-lim, max=lim))
    np.testing.assert_allclose(ref("linear", h, mlp.down_proj.weight.detach().numpy()), want, rtol=0, atol=1e-5)

    ex = DeepseekV4Experts(cfg).float()
    _randomize(ex, gen)
    ids = np.stack([gen.choice(cfg.n_routed_experts, 2, replace=False) for _ in range(T)]).astype(np.int32)
    w = gen.random((T, 2)).astype(np.float32)
    with torch.no_grad():
        want = ex(torch.from_numpy(x), torch.from_numpy(ids).long(), torch.from_numpy(w)).numpy()
    gu, down = ex.gate_up_proj.detach().numpy(), ex.down_proj.detach().numpy()
    F = cfg.moe_intermediate_size
    got = ref("moe_experts", x, w, ids, gu[:, :F], gu[:, F:], down, act="clamped_silu", limit=lim)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("hashed", [True, False])
def test_routers_vs_hf(hashed):
    """DeepseekV4HashRouter: moe_route_table(tokens, table, logits=, scoring="sqrtsoftplus",
    normalize=true, scale=rsf); DeepseekV4TopKRouter: moe_route(..., scoring="sqrtsoftplus", bias=)."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HashRouter, DeepseekV4TopKRouter
    gen = np.random.default_rng(3)
    cfg = _cfg()
    E, K, V = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.vocab_size
    router = (DeepseekV4HashRouter if hashed else DeepseekV4TopKRouter)(cfg).float()
    _randomize(router, gen)
    x = gen.standard_normal((T, H)).astype(np.float32)
    tokens = gen.integers(0, V, T).astype(np.int32)
    with torch.no_grad():
        if hashed:
            router.tid2eid.copy_(torch.from_numpy(np.stack([gen.choice(E, K, replace=False) for _ in range(V)])))
            _, w, ids = router(torch.from_numpy(x), torch.from_numpy(tokens).long())
        else:
            router.e_score_correction_bias.copy_(torch.from_numpy(gen.standard_normal(E).astype(np.float32) * 0.3))
            _, w, ids = router(torch.from_numpy(x))
    logits = ref("linear", x, router.weight.detach().numpy())
    if hashed:
        table = router.tid2eid.numpy().astype(np.int32)
        got_w, got_ids = ref("moe_route_table", tokens, table, logits, scoring="sqrtsoftplus", normalize=True,
                             scale=1.5, has_logits=True)
        np.testing.assert_array_equal(got_ids, ids.numpy())
    else:
        got_w, got_ids = ref("moe_route", logits, router.e_score_correction_bias.numpy(), k=K, normalize=True,
                             scale=1.5, scoring="sqrtsoftplus", has_bias=True)
        ids, w = ids.numpy(), w.numpy()
        order = np.argsort(ids, -1)               # torch.topk(sorted=False): compare as sets
        ids, w = np.take_along_axis(ids, order, -1), np.take_along_axis(w, order, -1)
        order = np.argsort(got_ids, -1)
        got_ids, got_w = np.take_along_axis(got_ids, order, -1), np.take_along_axis(got_w, order, -1)
        np.testing.assert_array_equal(got_ids, ids)
    np.testing.assert_allclose(got_w, np.asarray(w), rtol=0, atol=1e-5)


def _t(shape, dtype="f32"):
    return TensorType(tuple(shape), dtype)


@pytest.mark.parametrize("name,types,attrs,msg", [
    ("hc_mix", [_t(("T", 4, 8)), _t((24, 31))], {"eps": 1e-6}, "fn must be [M, N * H] = [M, 32]"),
    ("hc_weights", [_t(("T", 23)), _t((23,)), _t((3,))], {"iters": 3}, "is not (2 + N) N"),
    ("hc_weights", [_t(("T", 24)), _t((24,)), _t((1,))], {"iters": 3}, "scale must be [3]"),
    ("hc_weights", [_t(("T", 24)), _t((24,)), _t((3,))], {"iters": 0}, "iters (hc_sinkhorn_iters) must be an int >= 1"),
    ("hc_head_weights", [_t(("T", 4)), _t((4,)), _t((3,))], {}, "scale must be [1]"),
    ("hc_collapse", [_t(("T", 4, 8)), _t(("T", 3))], {}, "pre must be [T, N] = [T, 4]"),
    ("hc_collapse", [_t(("T", 32)), _t(("T", 4))], {}, "x must be the streams [T, N, H]"),
    ("hc_expand", [_t(("T", 8)), _t(("T", 4, 8)), _t(("T", 4)), _t(("T", 4, 3))], {}, "comb must be [T, N, N]"),
    ("hc_expand", [_t(("T", 9)), _t(("T", 4, 8)), _t(("T", 4)), _t(("T", 4, 4))], {}, "y (the sublayer's output)"),
    ("hc_streams", [_t(("T", 8))], {"n": 0}, "n (hc_mult) must be an int >= 1"),
    ("moe_route_table", [_t(("T",), "i32"), _t((50, 2), "i32")], {"scoring": "sqrtsoftplus"}, "give logits="),
    ("moe_route_table", [_t(("T",), "i32"), _t((50, 2), "i32"), _t(("T",))], {"has_logits": True}, "logits must be [T, E]"),
    ("moe_route_table", [_t(("T",), "i32"), _t((50, 2), "i32"), _t(("T", 6))], {"has_logits": True, "scoring": "relu"},
     "scoring must be one of"),
])
def test_shape_errors(name, types, attrs, msg):
    with pytest.raises(ShapeError) as e:
        REGISTRY[name].infer(types, attrs)
    assert msg in str(e.value)


def test_shapes():
    w = REGISTRY["hc_weights"].infer([_t(("T", 24)), _t((24,)), _t((3,))], {"iters": 20})
    assert [x.shape for x in w] == [("T", 4), ("T", 4), ("T", 4, 4)] and all(x.dtype == "f32" for x in w)
    assert REGISTRY["hc_collapse"].infer([_t(("T", 4, 8), "bf16"), _t(("T", 4))], {})[0] == _t(("T", 8), "bf16")
    assert REGISTRY["hc_streams"].infer([_t(("T", 8), "bf16")], {"n": 4})[0] == _t(("T", 4, 8), "bf16")
