"""FlexOlmo (specs/flex_olmo.yaml: FlexOlmoForCausalLM) against transformers' own model: tiny
random float32 checkpoints made by transformers and saved with save_pretrained (its default
save_original_format=True writes the per-expert layout mlp.experts.{e}.gate_proj.weight etc.),
hidden 96, 6 query heads over 2 KV heads of 16 (q/k norms over the whole projected widths, 96 and
32), two layers of 6 SwiGLU experts of 40 behind OLMoE's softmax router, OLMo 2's post-sublayer
norms and no pre-norms:
  bias:   top-2 renormalized, q/k/v/o biases (published: neither)
  plain:  FlexOlmo-7x7B's form: 7 experts, top-4 not renormalized, no biases, the config.json
          rewritten into the published (transformers 4.x) form (rope_theta at the top level);
          weights of std 0.15 (bias: 0.08), so that bf16 flips no expert choice on the kernel
          protocol's prompts (HF's own bf16 logits within 2e-2 of its float32 ones on both)
Every RMSNorm and every bias are random (HF initializes them to 1 and 0).

norm_topk_prob is passed through as HF reads it, but it barely shows in the logits: the
post-feedforward RMSNorm divides out the one per-token factor renormalizing the chosen weights
applies (only rms_norm_eps keeps it visible: ~2e-4 here), so no check below takes it out.

The reference executor must give HF's (eager, float32) logits at every position of a 24-token
prompt within 1e-4, as 24 prefixes in one step and one token per step, and the same 16 greedy
tokens as generate(); the generated kernels under the interpreter (TRITON_INTERPRET=1), fused and
--no-fuse, match the reference (tests/test_glm4_moe.py's checks); each distinctive feature, taken
out of the spec, moves the logits away from HF's.
"""
import json

import pytest
import torch

from infc.compiler.build import compile_model

from exhaustive import EXHAUSTIVE
from families import (checkpoint_tensors, hf_greedy, hf_logits, plan_and_weights, reference_greedy,
                      tiny_hf)
from test_deepseek_v2 import PROMPT, VOCAB, assert_logits, make_all
from test_dots1 import assert_break_bites
from test_glm4_moe import check_kernels

BASE = dict(vocab_size=VOCAB, hidden_size=96, intermediate_size=40, num_hidden_layers=2,
            num_attention_heads=6, num_key_value_heads=2, rms_norm_eps=1e-6,
            max_position_embeddings=512, initializer_range=0.08, tie_word_embeddings=False,
            pad_token_id=0, eos_token_id=1,
            rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
VARIANTS = {
    "bias": dict(num_experts=6, num_experts_per_tok=2, norm_topk_prob=True, attention_bias=True),
    # larger weights than bias's: at 0.08 a near-tie of the 4th and 5th experts at the protocol's
    # second sequence flips under bf16 (HF's own bf16 logits 0.39 away there: the router reads the
    # un-normed residual stream and the post-norm amplifies the change)
    "plain": dict(num_experts=7, num_experts_per_tok=4, norm_topk_prob=False, attention_bias=False,
                  initializer_range=0.15),
}


def randomize(model, seed=7):
    """Every norm weight 1 + 0.3 N(0, 1), every bias 0.1 N(0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))


def make(kind: str, d, **over):
    from transformers import FlexOlmoConfig, FlexOlmoForCausalLM
    model = tiny_hf(FlexOlmoForCausalLM, FlexOlmoConfig, {**BASE, **VARIANTS[kind], **over},
                    d, 4330, randomize=randomize)
    if kind == "plain":             # the published (transformers 4.x) form of config.json
        c = json.loads((d / "config.json").read_text())
        c["rope_theta"] = c.pop("rope_parameters")["rope_theta"]
        c["rope_scaling"] = None
        (d / "config.json").write_text(json.dumps(c, indent=2))
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_all(tmp_path_factory, "flex_olmo", VARIANTS, make)


def test_published_names_and_plan(models):
    """The checkpoints have the per-expert names, no pre-norm (input_layernorm), the post norms
    and whole-width q/k norms; the plan reads them, the norm weights f32 (OLMo 2's rounding)."""
    for kind, (d, _) in models.items():
        tensors = checkpoint_tensors(d)
        names = set(tensors)
        E = VARIANTS[kind]["num_experts"]
        assert f"model.layers.1.mlp.experts.{E - 1}.down_proj.weight" in names
        assert "model.layers.0.mlp.gate.weight" in names
        assert "model.layers.0.post_feedforward_layernorm.weight" in names
        assert not any("input_layernorm" in n or "gate_up_proj" in n for n in names)
        assert tensors["model.layers.0.self_attn.q_norm.weight"].shape == (96,)
        assert tensors["model.layers.0.self_attn.k_norm.weight"].shape == (32,)
        assert ("model.layers.0.self_attn.o_proj.bias" in names) == (kind == "bias")
        plan, _ = plan_and_weights(d)
        for w in ("q_norm", "k_norm", "post_attn_norm", "post_mlp_norm", "final_norm"):
            assert plan["weights"][w]["dtype"] == "f32", w
        assert (plan["config"]["E"], plan["config"]["theta"]) == (E, 500000.0)


@pytest.mark.parametrize("kind", list(VARIANTS))
def test_logits_and_greedy_match_hf(models, kind):
    d, hf = models[kind]
    want = hf_logits(hf, PROMPT)
    plan, weights = plan_and_weights(d)
    assert_logits(plan, weights, want, PROMPT)
    greedy = hf_greedy(hf, PROMPT, 16, VOCAB - 1)
    assert reference_greedy(plan, weights, PROMPT, 16) == greedy


BREAKS = {   # feature -> (variant, old spec text, the text that takes the feature out)
    # a pre-norm (OLMoE's) in place of the post-norms
    "post_norms": ("plain", "x = add(x, rms_norm(m, post_mlp_norm, eps))", "x = add(x, m)"),
    "attn_post_norm": ("plain", "rms_norm(linear(view(a, [T, Hq*D]), wo, bias=bo), post_attn_norm, eps)",
                       "linear(view(a, [T, Hq*D]), wo, bias=bo)"),
    "whole_width_qk_norm": ("plain", "q = view(rms_norm(linear(x, wq, bias=bq), q_norm, eps), [T, Hq, D])",
                            "q = view(linear(x, wq, bias=bq), [T, Hq, D])"),
    # no pre-norm: the experts read the residual stream itself
    "no_pre_norm": ("bias", "moe_experts(x, topw", "moe_experts(rms_norm(x, eps=eps), topw"),
    "biases": ("bias", "wo, bias=bo)", "wo)"),
}


@pytest.mark.parametrize("feature", list(BREAKS))
def test_feature_taken_out_moves_logits(models, feature, tmp_path):
    kind, old, new = BREAKS[feature]
    assert_break_bites(models, kind, "flex_olmo.yaml", old, new, tmp_path)


def test_not_an_olmoe_or_olmo2_alias(models, tmp_path):
    """OLMoE's spec (pre-norms, a Llama-style norm) cannot read this checkpoint: the family is its
    own, not an alias."""
    from infc.compiler.contract.errors import SpecError
    from infc.compiler.spec import SPECS_DIR
    d, _ = models["plain"]
    with pytest.raises(SpecError, match="input_layernorm"):
        compile_model(model_dir=str(d), spec_path=str(SPECS_DIR / "olmoe.yaml"))


# -- configs ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", ["flexolmo-7x7b-1t", "flexolmo-7x7b-1t-rt"])
def test_published_variants_agree_with_hf(variant):
    """Each variant (published config.json values, no weights) builds, and what the plan derives
    agrees with what transformers derives from the same values."""
    from transformers import FlexOlmoConfig
    from infc.compiler.spec import SPECS_DIR, load_spec
    values = dict(load_spec(SPECS_DIR / "flex_olmo.yaml").variants[variant])
    _, plan = compile_model(variant)
    hf = FlexOlmoConfig(**{k: v for k, v in values.items() if k not in ("architectures", "model_type")})
    c = plan["config"]
    assert c["D"] == hf.hidden_size // hf.num_attention_heads == 128
    assert (c["E"], c["K"], c["F"], c["L"], c["V"], c["Hkv"], c["norm_topk"]) == \
        (hf.num_experts, hf.num_experts_per_tok, hf.intermediate_size, hf.num_hidden_layers,
         hf.vocab_size, hf.num_key_value_heads, hf.norm_topk_prob)
    assert (c["theta"], c["eps"], c["attn_bias"]) == \
        (hf.rope_parameters["rope_theta"], hf.rms_norm_eps, hf.attention_bias)
    assert plan["weights"]["q_norm"]["shape"][-1] == hf.num_attention_heads * 128


def test_config_defaults_are_hf(models, tmp_path):
    """A config.json without the optional keys binds to the values HF's FlexOlmoConfig gives them
    (7 experts, top-5, not renormalized, theta 500000, eps 1e-6, no biases, untied)."""
    from transformers import FlexOlmoConfig
    d, _ = models["plain"]
    c = json.loads((d / "config.json").read_text())
    keep = ("architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
            "num_hidden_layers", "num_attention_heads")
    cfg = {k: c[k] for k in keep}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    _, plan = compile_model(model_dir=str(tmp_path), check_checkpoint=False)
    hf = FlexOlmoConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    got = plan["config"]
    assert (got["E"], got["K"], got["norm_topk"], got["theta"], got["eps"], got["attn_bias"], got["tie"],
            got["Hkv"], got["max_len"], got["act"]) == \
        (hf.num_experts, hf.num_experts_per_tok, hf.norm_topk_prob, hf.rope_parameters["rope_theta"],
         hf.rms_norm_eps, hf.attention_bias, hf.tie_word_embeddings, hf.num_key_value_heads,
         hf.max_position_embeddings, hf.hidden_act)


# -- through the generated kernels (interpreted) ---------------------------------------------------

@pytest.mark.parametrize("kind,fuse", [
    ("bias", True),
    pytest.param("bias", False, marks=EXHAUSTIVE),
    pytest.param("plain", True, marks=EXHAUSTIVE),
    pytest.param("plain", False, marks=EXHAUSTIVE),
], ids=["bias-fused", "bias-no-fuse", "plain-fused", "plain-no-fuse"])
def test_through_kernels(models, kind, fuse, tmp_path):
    check_kernels(*models[kind], tmp_path, fuse)


def test_no_narrow_program(models):
    """The narrow program (one sequence's decode with the norms merged into the GEMVs) is not
    built for this family (whole-width q/k norms and post-norms, as OLMo 2's), so the one- and
    two-sequence decode steps run through the decode and wide programs test_through_kernels
    checks; were a narrow program added, tests/test_deepseek_v2_interp.py's check_through_kernels
    should be run here."""
    plan, _ = plan_and_weights(models["bias"][0])
    assert "narrow" not in plan["programs"] and not plan.get("narrow_tokens")
