"""K-EXAONE (specs/exaone_moe.yaml: ExaoneMoeForCausalLM) against transformers' own model: tiny
random float32 checkpoints made by transformers and saved with save_pretrained (the published
names: mlp.gate.weight, mlp.e_score_correction_bias, mlp.shared_experts.*, mlp.experts.{e}.*),
hidden 96, 4 query heads over 2 KV heads, per-head q/k RMSNorm, 8 routed experts:
  kexaone: K-EXAONE's form: layers sliding, sliding, sliding, global (HF's default layer_types from
           sliding_window_pattern 4; a window of 5 under a 24-token prompt; the global layer NoPE),
           the first layer dense (first_k_dense_replace), head_dim 32 (not hidden / heads), 4
           groups of which the best 2 are kept, top-2, norm_topk_prob, routed_scaling_factor 2.5
  mixed:   layer_types global, global, sliding and mlp_layer_types sparse, dense, sparse given
           explicitly, head_dim hidden / heads (24: HF's default), one group, top-3, no
           renormalization, routed_scaling_factor 1.5, two shared experts
Every RMSNorm weight and the correction bias (large enough to move the choices) are random.

The reference executor gives HF's (eager, float32) logits at every position of a 24-token prompt
within 1e-4, as 24 prefixes in one step and one token per step, and the same 16 greedy tokens as
generate(); the generated kernels under the interpreter, fused and --no-fuse, match the reference;
each distinctive feature moves the logits when taken out of the spec; a checkpoint carrying the
published mtp.* module builds (the tensors under `ignore:`) and gives the same logits.
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
            num_attention_heads=4, num_key_value_heads=2, num_experts=8, rms_norm_eps=1e-5,
            max_position_embeddings=512, initializer_range=0.08, sliding_window=5,
            tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
VARIANTS = {
    "kexaone": dict(num_hidden_layers=4, head_dim=32, sliding_window_pattern=4, first_k_dense_replace=1,
                    n_group=4, topk_group=2, num_experts_per_tok=2, norm_topk_prob=True,
                    routed_scaling_factor=2.5, num_shared_experts=1),
    "mixed": dict(num_hidden_layers=3, layer_types=["full_attention", "full_attention", "sliding_attention"],
                  mlp_layer_types=["sparse", "dense", "sparse"], n_group=1, topk_group=1,
                  num_experts_per_tok=3, norm_topk_prob=False, routed_scaling_factor=1.5, num_shared_experts=2),
}
SCHEDULES = {"kexaone": ["rope_dense", "rope_sparse", "rope_sparse", "nope_sparse"],
             "mixed": ["nope_sparse", "nope_dense", "rope_sparse"]}


def randomize(model, seed=7):
    """Every norm weight 1 + 0.3 N(0, 1), every correction bias 0.5 N(0, 1) (it moves choices)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                gate.e_score_correction_bias.copy_(0.5 * torch.randn(gate.e_score_correction_bias.shape, generator=gen))


def make(kind: str, d, **over):
    from transformers import ExaoneMoeConfig, ExaoneMoeForCausalLM
    return tiny_hf(ExaoneMoeForCausalLM, ExaoneMoeConfig, {**BASE, **VARIANTS[kind], **over},
                   d, 4333, randomize=randomize)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_all(tmp_path_factory, "exaone_moe", VARIANTS, make)


def test_published_names_and_layer_kinds(models):
    """The checkpoint has the published names and the plan reads them: the layer kinds follow
    layer_types (or HF's default from sliding_window_pattern) and mlp_layer_types (or
    first_k_dense_replace), the head dim HF's, the correction bias f32, the routers sigmoid-scored
    with the bias."""
    for kind, (d, hf) in models.items():
        names = set(checkpoint_tensors(d))
        assert "model.layers.2.mlp.gate.weight" in names
        assert "model.layers.2.mlp.e_score_correction_bias" in names
        assert "model.layers.2.mlp.shared_experts.down_proj.weight" in names
        assert "model.layers.2.mlp.experts.7.gate_proj.weight" in names
        assert not any("gate_up_proj" in n or "gate.e_score" in n for n in names)
        plan, _ = plan_and_weights(d)
        repeat = next(e for e in plan["programs"]["decode"] if "repeat" in e)
        assert repeat["schedule"] == SCHEDULES[kind], kind
        assert repeat["schedule"] == [("rope_" if t == "sliding_attention" else "nope_") + m
                                      for t, m in zip(hf.config.layer_types, hf.config.mlp_layer_types)]
        assert plan["config"]["D"] == hf.model.layers[0].self_attn.head_dim
        assert plan["weights"]["router_bias"]["dtype"] == "f32"
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


def test_checkpoint_with_mtp_module_builds(models, tmp_path):
    """The published checkpoint carries its multi-token-prediction module as mtp.* (HF ignores it
    on load): the spec's `ignore:` lets it build, with the same logits."""
    from test_spec_mtp import _save
    d, hf = models["kexaone"]
    t, c = checkpoint_tensors(d), json.loads((d / "config.json").read_text())
    rng = np.random.default_rng(5)
    H = BASE["hidden_size"]
    for n in ("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight",
              "mtp.layers.0.input_layernorm.weight"):
        t[n] = (1 + 0.3 * rng.standard_normal(H)).astype(np.float32)
    t["mtp.fc.weight"] = (0.1 * rng.standard_normal((H, 2 * H))).astype(np.float32)
    _save(tmp_path, t, {**c, "num_nextn_predict_layers": 1})
    plan, weights = plan_and_weights(tmp_path)
    assert not any("mtp" in json.dumps(w["source"]) for w in plan["weights"].values())
    assert_logits(plan, weights, hf_logits(hf, PROMPT), PROMPT)


def test_in_memory_layout_reads_the_same(models, tmp_path):
    """A save_original_format=False checkpoint (mlp.gate.e_score_correction_bias, fused
    experts.gate_up_proj) is read through the `or:` layouts and gives the same logits."""
    d, hf = models["mixed"]
    hf.save_pretrained(tmp_path, save_original_format=False)
    names = set(checkpoint_tensors(tmp_path))
    assert "model.layers.0.mlp.gate.e_score_correction_bias" in names
    assert "model.layers.0.mlp.experts.gate_up_proj" in names
    plan, weights = plan_and_weights(tmp_path)
    assert_logits(plan, weights, hf_logits(hf, PROMPT), PROMPT)


# -- each feature bites: the spec with it taken out is far from HF ---------------------------------

ROPE_QK = "rope(q, theta, rope_scaling), rope(k, theta, rope_scaling), v"
BREAKS = {
    "correction_bias": (', scoring="sigmoid", bias=router_bias)', ', scoring="sigmoid")'),
    "group_limit": ("groups=n_group, topk_groups=topk_group, ", ""),
    "renormalize": ("moe_route(linear(h, router), K, norm_topk,", "moe_route(linear(h, router), K, true,"),
    "scale": ("scale=rsf, ", ""),
    "nope": ("a = attention(q, k, v)", f"a = attention({ROPE_QK})"),
    "window": ("symbols: {window: swa}", "symbols: {window: none}"),      # the sliding kinds' window
    "k_norm": ("k = rms_norm(view(linear(h, wk), [T, Hkv, D]), k_norm, eps)", "k = view(linear(h, wk), [T, Hkv, D])"),
    "shared": ("add(moe_experts(h, topw, topi, we_gate, we_up, we_down), shared)",
               "moe_experts(h, topw, topi, we_gate, we_up, we_down)"),
}
KIND_OF = {"renormalize": "mixed", "shared": "mixed"}


@pytest.mark.parametrize("feature", list(BREAKS))
def test_each_feature_bites(models, feature, tmp_path):
    d, hf = models[KIND_OF.get(feature, "kexaone")]
    want = hf_logits(hf, PROMPT)[-1]
    got = broken_logits(d, tmp_path, *BREAKS[feature], family="exaone_moe")[0]
    assert np.abs(got - want).max() > 1e-2, feature


# -- configs -----------------------------------------------------------------------------------------

def test_published_variant_agrees_with_hf():
    """The variant (published config.json values, no weights) builds, and what the plan derives
    agrees with what transformers derives from the same values: the layer kinds (layer_types x
    mlp_layer_types), the head dims, the shared expert's width, the router's parameters."""
    from transformers import ExaoneMoeConfig
    from infc.compiler.spec import SPECS_DIR, load_spec
    values = dict(load_spec(SPECS_DIR / "exaone_moe.yaml").variants["k-exaone-236b-a23b"])
    _, plan = compile_model("k-exaone-236b-a23b")
    hf = ExaoneMoeConfig(**{k: v for k, v in values.items() if k not in ("architectures", "model_type", "torch_dtype")})
    schedule = next(r for r in plan["programs"]["decode"] if "repeat" in r)["schedule"]
    assert schedule == [("rope_" if t == "sliding_attention" else "nope_") + m
                        for t, m in zip(hf.layer_types, hf.mlp_layer_types)]
    c = plan["config"]
    assert (c["D"], c["Hq"], c["Hkv"], c["E"], c["K"], c["F"], c["Fe"], c["swa"]) == \
        (hf.head_dim, hf.num_attention_heads, hf.num_key_value_heads, hf.num_experts,
         hf.num_experts_per_tok, hf.intermediate_size, hf.moe_intermediate_size, hf.sliding_window)
    assert c["Fs"] == hf.moe_intermediate_size * hf.num_shared_experts
    assert (c["rsf"], c["norm_topk"], c["n_group"], c["topk_group"], c["theta"]) == \
        (hf.routed_scaling_factor, hf.norm_topk_prob, hf.n_group, hf.topk_group, hf.rope_parameters["rope_theta"])


def test_config_defaults_are_hf(tmp_path):
    """A config.json with only the required keys binds to the values HF's ExaoneMoeConfig gives the
    others (head_dim hidden / heads, the window and its pattern, one dense layer, the router's
    groups, scale and renormalization, eps, theta, untied)."""
    from transformers import ExaoneMoeConfig
    cfg = {"architectures": ["ExaoneMoeForCausalLM"], "model_type": "exaone_moe", "num_hidden_layers": 5}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    _, plan = compile_model(model_dir=str(tmp_path), check_checkpoint=False)
    hf = ExaoneMoeConfig(num_hidden_layers=5)
    c = plan["config"]
    assert (c["H"], c["Hq"], c["Hkv"], c["D"], c["F"], c["Fe"], c["E"], c["K"], c["n_shared"], c["first_dense"],
            c["n_group"], c["topk_group"], c["rsf"], c["norm_topk"], c["V"], c["eps"], c["theta"], c["tie"],
            c["act"], c["max_len"], c["swa"], c["pattern"]) == \
        (hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads, hf.hidden_size // hf.num_attention_heads,
         hf.intermediate_size, hf.moe_intermediate_size, hf.num_experts, hf.num_experts_per_tok,
         hf.num_shared_experts, hf.first_k_dense_replace, hf.n_group, hf.topk_group, hf.routed_scaling_factor,
         hf.norm_topk_prob, hf.vocab_size, hf.rms_norm_eps, hf.rope_parameters["rope_theta"],
         hf.tie_word_embeddings, hf.hidden_act, hf.max_position_embeddings, hf.sliding_window,
         hf.sliding_window_pattern)
    schedule = next(r for r in plan["programs"]["decode"] if "repeat" in r)["schedule"]
    assert schedule == [("rope_" if t == "sliding_attention" else "nope_") + m
                        for t, m in zip(hf.layer_types, hf.mlp_layer_types)]


# -- through the generated kernels (interpreted) ---------------------------------------------------

@pytest.mark.parametrize("kind,fuse", [
    ("kexaone", True),
    pytest.param("kexaone", False, marks=EXHAUSTIVE),
    pytest.param("mixed", True, marks=EXHAUSTIVE),
    pytest.param("mixed", False, marks=EXHAUSTIVE),
], ids=["kexaone-fused", "kexaone-no-fuse", "mixed-fused", "mixed-no-fuse"])
def test_through_kernels(models, kind, fuse, tmp_path):
    check_kernels(*models[kind], tmp_path, fuse)


@pytest.mark.parametrize("over,cond", [
    ({"hidden_act": "gelu"}, 'act == "silu"'),
    ({"n_group": 3}, "n_group >= 1 and topk_group >= 1 and topk_group <= n_group and E % n_group == 0"),
])
def test_unsupported_configs_fail_clearly(tmp_path, over, cond):
    """A configuration the spec does not cover fails at build, naming the requirement."""
    import re
    from infc.compiler.contract.errors import SpecError
    cfg = {"architectures": ["ExaoneMoeForCausalLM"], "model_type": "exaone_moe", "num_hidden_layers": 3, **over}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SpecError, match=re.escape(f"requirement '{cond}' does not hold")):
        compile_model(model_dir=str(tmp_path), check_checkpoint=False)

