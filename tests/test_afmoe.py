"""Arcee Trinity (specs/afmoe.yaml: AfmoeForCausalLM) against transformers' own model: tiny random
float32 checkpoints made by transformers and saved with save_pretrained (the published names:
mlp.router.gate.weight, mlp.expert_bias, mlp.shared_experts.*, mlp.experts.{e}.*), hidden 96,
4 query heads over 2 KV heads of head_dim 32, per-head q/k RMSNorm, the sigmoid output gate, pre
and post norms around both sublayers, 8 routed experts:
  trinity: Trinity's form: layers sliding+dense, full+MoE, sliding+MoE, full+MoE (HF's default
           layer_types, global_attn_every_n_layers 2; a window of 5 under a 24-token prompt), muP
           embedding scale, top-2, route_scale 2.826, one shared expert, no biases
  biased:  layer_types full, sliding, full given explicitly, two dense layers, q/k/v/o biases, no
           muP, top-3, route_scale 1.5, two shared experts
Every RMSNorm weight, every bias, the router weights (HF initializes them to 0) and the expert
bias (large enough to move the choices) are random.

The reference executor gives HF's (eager, float32) logits at every position of a 24-token prompt
within 1e-4, as 24 prefixes in one step and one token per step, and the same 16 greedy tokens as
generate(); the generated kernels under the interpreter, fused and --no-fuse, match the reference;
each distinctive feature moves the logits when taken out of the spec.
"""
import json

import numpy as np
import pytest
import torch

from infc.compiler.build import compile_model

from exhaustive import EXHAUSTIVE
from families import (checkpoint_tensors, hf_greedy, hf_logits, plan_and_weights, reference_greedy,
                      tiny_hf)
from test_deepseek_v2 import PROMPT, VOCAB, assert_logits, make_all
from test_hy_v3 import broken_logits, check_kernels

BASE = dict(vocab_size=VOCAB, hidden_size=96, intermediate_size=128, moe_intermediate_size=32,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8,
            rms_norm_eps=1e-5, max_position_embeddings=512, initializer_range=0.08, sliding_window=5,
            tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
VARIANTS = {
    "trinity": dict(num_hidden_layers=4, num_dense_layers=1, global_attn_every_n_layers=2,
                    mup_enabled=True, num_experts_per_tok=2, route_scale=2.826, num_shared_experts=1),
    "biased": dict(num_hidden_layers=3, num_dense_layers=2,
                   layer_types=["full_attention", "sliding_attention", "full_attention"],
                   attention_bias=True, mup_enabled=False, num_experts_per_tok=3, route_scale=1.5,
                   num_shared_experts=2),
}
SCHEDULES = {"trinity": ["sliding_dense", "full_moe", "sliding_moe", "full_moe"],
             "biased": ["full_dense", "sliding_dense", "full_moe"]}


def randomize(model, seed=7):
    """Every norm weight 1 + 0.3 N(0, 1), every bias 0.1 N(0, 1), every router weight 0.08 N(0, 1)
    (HF's init is 0: every score 0.5), every expert bias 0.3 N(0, 1) (it moves choices)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("router.gate.weight"):
                p.copy_(0.08 * torch.randn(p.shape, generator=gen))
            elif name.endswith("expert_bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))


def make(kind: str, d, **over):
    from transformers import AfmoeConfig, AfmoeForCausalLM
    return tiny_hf(AfmoeForCausalLM, AfmoeConfig, {**BASE, **VARIANTS[kind], **over},
                   d, 4332, randomize=randomize)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_all(tmp_path_factory, "afmoe", VARIANTS, make)


def test_published_names_and_layer_kinds(models):
    """The checkpoint has the published names and the plan reads them: the layer kinds follow
    layer_types (or HF's default from global_attn_every_n_layers) and num_dense_layers, the norms
    and the expert bias are f32, the routers sigmoid-scored with the bias."""
    for kind, (d, hf) in models.items():
        names = set(checkpoint_tensors(d))
        assert "model.layers.2.mlp.router.gate.weight" in names
        assert "model.layers.2.mlp.expert_bias" in names
        assert "model.layers.2.mlp.shared_experts.down_proj.weight" in names
        assert "model.layers.2.mlp.experts.7.gate_proj.weight" in names
        assert "model.layers.0.self_attn.gate_proj.weight" in names
        assert not any("gate_up_proj" in n or "e_score_correction_bias" in n for n in names)
        plan, _ = plan_and_weights(d)
        repeat = next(e for e in plan["programs"]["decode"] if "repeat" in e)
        assert repeat["schedule"] == SCHEDULES[kind], kind
        want = [("sliding" if t == "sliding_attention" else "full") for t in hf.config.layer_types]
        assert [s.split("_")[0] for s in repeat["schedule"]] == want
        for w in ("router_bias", "attn_norm", "q_norm", "post_attn_norm", "pre_mlp_norm", "post_mlp_norm",
                  "final_norm"):
            assert plan["weights"][w]["dtype"] == "f32", w
        routes = [n for n in json.dumps(plan["programs"]["prefill"]).split('"op": ') if n.startswith('"moe_route')]
        assert routes and all('"scoring": "sigmoid"' in n and '"has_bias": true' in n for n in routes)


@pytest.mark.parametrize("kind", list(VARIANTS))
def test_logits_and_greedy_match_hf(models, kind):
    d, hf = models[kind]
    want = hf_logits(hf, PROMPT)
    plan, weights = plan_and_weights(d)
    assert_logits(plan, weights, want, PROMPT)
    assert np.abs(want[1:] - want[:-1]).max() > 0.1          # no near-constant model
    greedy = hf_greedy(hf, PROMPT, 16, VOCAB - 1)
    assert reference_greedy(plan, weights, PROMPT, 16) == greedy


# -- each feature bites: the spec with it taken out is far from HF ---------------------------------

ROPE_QK = "rope(q, theta, rope_scaling), rope(k, theta, rope_scaling), v"
BREAKS = {
    "expert_bias": (', scoring="sigmoid", bias=router_bias)', ', scoring="sigmoid")'),
    "renormalize": ("moe_route(linear(h, router), K, true,", "moe_route(linear(h, router), K, false,"),
    "route_scale": ("K, true, scale=rsf,", "K, true,"),
    "output_gate": ("a = mul(view(a, [T, Hq*D]), sigmoid(linear(h, wgate)))", "a = view(a, [T, Hq*D])"),
    "post_attn_norm": ("rms_norm(linear(a, wo, bias=bo), post_attn_norm, eps)", "linear(a, wo, bias=bo)"),
    "post_mlp_norm": ("x = add(x, rms_norm(y, post_mlp_norm, eps))", "x = add(x, y)"),
    "nope": ("a = attention(q, k, v)", f"a = attention({ROPE_QK})"),
    "window": (f"attention({ROPE_QK}, window=swa)", f"attention({ROPE_QK})"),
    "mup": ("emb_scale: = H ** 0.5 if mup else 1.0", "emb_scale: = 1.0"),
    "q_norm": ("q = rms_norm(view(linear(h, wq, bias=bq), [T, Hq, D]), q_norm, eps)",
               "q = view(linear(h, wq, bias=bq), [T, Hq, D])"),
}


@pytest.mark.parametrize("feature", list(BREAKS))
def test_each_feature_bites(models, feature, tmp_path):
    d, hf = models["trinity"]
    want = hf_logits(hf, PROMPT)[-1]
    got = broken_logits(d, tmp_path, *BREAKS[feature], family="afmoe")[0]
    assert np.abs(got - want).max() > 1e-2, feature


# -- configs -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", ["trinity-nano", "trinity-mini", "trinity-large"])
def test_published_variants_agree_with_hf(variant):
    """Each variant (published config.json values, no weights) builds, and what the plan derives
    agrees with what transformers derives from the same values: the layer kinds (HF's layer_types
    and dense layers), the head dims, the shared experts' width, the scales."""
    from transformers import AfmoeConfig
    from infc.compiler.spec import SPECS_DIR, load_spec
    values = dict(load_spec(SPECS_DIR / "afmoe.yaml").variants[variant])
    _, plan = compile_model(variant)
    hf = AfmoeConfig(**{k: v for k, v in values.items() if k not in ("architectures", "model_type", "torch_dtype")})
    schedule = next(r for r in plan["programs"]["decode"] if "repeat" in r)["schedule"]
    assert schedule == [("sliding" if t == "sliding_attention" else "full") +
                        ("_dense" if i < hf.num_dense_layers else "_moe") for i, t in enumerate(hf.layer_types)]
    c = plan["config"]
    assert (c["D"], c["Hq"], c["Hkv"], c["E"], c["K"], c["F"], c["Fe"], c["swa"]) == \
        (hf.head_dim, hf.num_attention_heads, hf.num_key_value_heads, hf.num_experts,
         hf.num_experts_per_tok, hf.intermediate_size, hf.moe_intermediate_size, hf.sliding_window)
    assert c["Fs"] == hf.moe_intermediate_size * hf.num_shared_experts
    assert c["rsf"] == hf.route_scale and c["theta"] == hf.rope_parameters["rope_theta"]
    assert c["emb_scale"] == (hf.hidden_size ** 0.5 if hf.mup_enabled else 1.0)


def test_config_defaults_are_hf(tmp_path):
    """A config.json with only the required keys binds to the values HF's AfmoeConfig gives the
    others (KV heads = q heads, the window and global period, one dense layer, the expert counts,
    widths and scale, eps, theta, no biases, no muP, untied)."""
    from transformers import AfmoeConfig
    cfg = {"architectures": ["AfmoeForCausalLM"], "model_type": "afmoe", "num_hidden_layers": 5}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    _, plan = compile_model(model_dir=str(tmp_path), check_checkpoint=False)
    hf = AfmoeConfig(num_hidden_layers=5)
    c = plan["config"]
    assert (c["H"], c["Hq"], c["Hkv"], c["D"], c["F"], c["Fe"], c["E"], c["K"], c["n_shared"], c["n_dense"],
            c["rsf"], c["V"], c["eps"], c["theta"], c["attn_bias"], c["tie"], c["act"], c["max_len"], c["swa"],
            c["mup"]) == \
        (hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim, hf.intermediate_size,
         hf.moe_intermediate_size, hf.num_experts, hf.num_experts_per_tok, hf.num_shared_experts,
         hf.num_dense_layers, hf.route_scale, hf.vocab_size, hf.rms_norm_eps, hf.rope_parameters["rope_theta"],
         hf.attention_bias, hf.tie_word_embeddings, hf.hidden_act, hf.max_position_embeddings,
         hf.sliding_window, hf.mup_enabled)
    schedule = next(r for r in plan["programs"]["decode"] if "repeat" in r)["schedule"]
    assert [s.split("_")[0] for s in schedule] == \
        [("sliding" if t == "sliding_attention" else "full") for t in hf.layer_types]


# -- through the generated kernels (interpreted) ---------------------------------------------------

@pytest.mark.parametrize("kind,fuse", [
    ("trinity", True),
    pytest.param("trinity", False, marks=EXHAUSTIVE),
    pytest.param("biased", True, marks=EXHAUSTIVE),
    pytest.param("biased", False, marks=EXHAUSTIVE),
], ids=["trinity-fused", "trinity-no-fuse", "biased-fused", "biased-no-fuse"])
def test_through_kernels(models, kind, fuse, tmp_path):
    check_kernels(*models[kind], tmp_path, fuse)


@pytest.mark.parametrize("over,match", [
    ({"hidden_act": "gelu"}, "requirement 'act == \"silu\"' does not hold"),
    ({"num_shared_experts": 0}, "value of Fs .* must be a positive integer"),   # before n_shared >= 1
])
def test_unsupported_configs_fail_clearly(tmp_path, over, match):
    """A configuration the spec does not cover fails at build, naming what it breaks."""
    from infc.compiler.contract.errors import SpecError
    cfg = {"architectures": ["AfmoeForCausalLM"], "model_type": "afmoe", "num_hidden_layers": 3, **over}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SpecError, match=match):
        compile_model(model_dir=str(tmp_path), check_checkpoint=False)
