"""Phi-3.5-MoE (specs/phimoe.yaml: PhimoeForCausalLM) against transformers' own model, as far as
the spec language can say it: the sparsemixer router with router_jitter_noise 0 (the top two
experts by logit, each at weight 1); a published checkpoint (jitter 0.01, longrope) is refused.

A tiny random float32 checkpoint made by transformers and saved with save_pretrained (the
published names: block_sparse_moe.gate.weight, block_sparse_moe.experts.{e}.w1/w2/w3.weight),
hidden 96, 4 query heads over 2 KV heads of head_dim 32, two layers of 6 SwiGLU experts of 40,
LayerNorms with weight and bias, q/k/v/o biases, an lm_head bias, a sliding window of 5 on every
layer (shorter than the prompt). Every norm weight and bias and every linear bias are random (HF
initializes them to 1, 0 and 0).

The reference executor must give HF's (eager, float32) logits at every position of a 24-token
prompt within 1e-4, as 24 prefixes in one step and one token per step, and the same 16 greedy
tokens as generate(); the generated kernels under the interpreter, fused and --no-fuse, match
the reference; each distinctive feature, taken out of the spec, moves the logits away from HF's.
The sparsemixer's inference-time math is checked here in closed form against HF's function (the
semantics a router op for it would have; specs/phimoe.yaml's header), with the property that
keeps it out of the language today: its weights move when every logit moves by one constant.
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
from test_dots1 import assert_break_bites
from test_glm4_moe import check_kernels

BASE = dict(vocab_size=VOCAB, hidden_size=96, intermediate_size=40, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_local_experts=6,
            num_experts_per_tok=2, router_jitter_noise=0.0, input_jitter_noise=0.0,
            rms_norm_eps=1e-5, max_position_embeddings=512, initializer_range=0.08,
            tie_word_embeddings=False, attention_bias=True, lm_head_bias=True, sliding_window=5,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
VARIANTS = {"tiny": {}}


def randomize(model, seed=7):
    """Every norm weight 1 + 0.3 N(0, 1), every bias (norms', linears', lm_head's) 0.1 N(0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith(".weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))


def make(kind: str, d, **over):
    from transformers import PhimoeConfig, PhimoeForCausalLM
    return tiny_hf(PhimoeForCausalLM, PhimoeConfig, {**BASE, **VARIANTS[kind], **over},
                   d, 4330, randomize=randomize)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_all(tmp_path_factory, "phimoe", VARIANTS, make)


def test_published_names_and_plan(models):
    d, _ = models["tiny"]
    names = set(checkpoint_tensors(d))
    for n in ("model.layers.1.block_sparse_moe.gate.weight", "model.layers.1.block_sparse_moe.experts.5.w3.weight",
              "model.layers.0.input_layernorm.bias", "model.norm.bias", "lm_head.bias",
              "model.layers.0.self_attn.o_proj.bias"):
        assert n in names, n
    assert not any(".mlp." in n for n in names)
    plan, _ = plan_and_weights(d)
    assert plan["config"]["swa"] == 5 and plan["config"]["jitter"] == 0


@pytest.mark.parametrize("kind", list(VARIANTS))
def test_logits_and_greedy_match_hf(models, kind):
    d, hf = models[kind]
    want = hf_logits(hf, PROMPT)
    plan, weights = plan_and_weights(d)
    assert_logits(plan, weights, want, PROMPT)
    greedy = hf_greedy(hf, PROMPT, 16, VOCAB - 1)
    assert reference_greedy(plan, weights, PROMPT, 16) == greedy


BREAKS = {   # feature -> (old spec text, the text that takes the feature out)
    # the router's softmax probabilities as the weights (Mixtral's top-2, unnormalized)
    "unit_weights": ("threshold(topw, 1.0, 1.0)", "topw"),
    "layer_norm_bias": ("layer_norm(x, mlp_norm, bias=mlp_norm_b, eps=eps)", "layer_norm(x, mlp_norm, eps=eps)"),
    "lm_head_bias": ("lm_head, bias=lm_head_b)", "lm_head)"),
    "o_bias": ("wo, bias=bo)", "wo)"),
    "sliding_window": ("v, window=swa)", "v)"),
}


@pytest.mark.parametrize("feature", list(BREAKS))
def test_feature_taken_out_moves_logits(models, feature, tmp_path):
    old, new = BREAKS[feature]
    assert_break_bites(models, "tiny", "phimoe.yaml", old, new, tmp_path)


# -- the sparsemixer router --------------------------------------------------------------------------

def sparsemixer_closed_form(s: np.ndarray, eps: float):
    """The inference-time sparsemixer (HF's sparsemixer, training false) in closed form, float64:
    two rounds; round r takes the best expert i_r not yet chosen (m_r its logit), keeps the
    not-yet-chosen experts j with (m_r - s_j) / max(|s_j|, m_r) <= 2 eps, and weighs i_r by the
    softmax over the kept ones: 1 / sum_kept exp(s_j - m_r). Returns (weights [T, 2], ids [T, 2])."""
    s = np.asarray(s, np.float64)
    T, E = s.shape
    w, ids = np.zeros((T, 2)), np.zeros((T, 2), np.int64)
    for t in range(T):
        free = np.ones(E, bool)
        for r in range(2):
            i = int(np.argmax(np.where(free, s[t], -np.inf)))
            m = s[t, i]
            with np.errstate(invalid="ignore", divide="ignore"):
                far = (m - s[t]) / np.maximum(np.abs(s[t]), m) > 2 * eps
            kept = free & ~far
            w[t, r], ids[t, r] = 1.0 / np.exp(s[t, kept] - m).sum(), i
            free[i] = False
    return w, ids


def test_sparsemixer_closed_form_is_hfs_and_not_shift_invariant():
    """The closed form (the semantics a router op would implement) equals HF's sparsemixer at the
    published eps (0.01) and at 0; at 0 it is the top two by logit at weight 1 (what the spec
    says); at 0.01 the weights move when every logit moves by one constant, so no function of the
    softmax probabilities (moe_route's, shift invariant) and constants (threshold's) gives them."""
    from transformers.models.phimoe.modeling_phimoe import sparsemixer
    gen = torch.Generator().manual_seed(3)
    # logits a router gives: a few units, with near-ties inside the 2 eps margin
    s = torch.randn(64, 16, generator=gen) * 2.0
    s[::4, 1] = s[::4, 0] * 0.995
    for eps in (0.01, 0.0):
        hw, hi = sparsemixer(s, jitter_eps=eps, training=False)
        w, ids = sparsemixer_closed_form(s.numpy(), eps)
        assert (hi.numpy() == ids).all()
        np.testing.assert_allclose(hw.numpy(), w, rtol=1e-5, atol=1e-6)
        if eps == 0.0:
            assert (w == 1.0).all() and (ids == np.argsort(-s.numpy(), -1, kind="stable")[:, :2]).all()
    hw, _ = sparsemixer(s, jitter_eps=0.01, training=False)
    assert (hw != 1.0).any()                       # some tokens keep more than their expert
    shifted, _ = sparsemixer(s + 3.0, jitter_eps=0.01, training=False)
    assert (shifted - hw).abs().max() > 0.05       # the same differences, other weights


# Phi-3.5-MoE-instruct's config.json as recalled (no hub access here; specs/phimoe.yaml says why it
# is no variant there): its longrope short_factor / long_factor lists (64 numbers each, one per
# rotary pair) are not reproduced, [1.0] * 64 stands for each.
PUBLISHED = {"architectures": ["PhiMoEForCausalLM"], "model_type": "phimoe", "hidden_size": 4096,
             "intermediate_size": 6400, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 8, "num_local_experts": 16, "num_experts_per_tok": 2,
             "vocab_size": 32064, "max_position_embeddings": 131072,
             "original_max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
             "sliding_window": 131072, "attention_bias": True, "lm_head_bias": True,
             "tie_word_embeddings": False, "hidden_act": "silu", "router_jitter_noise": 0.01,
             "input_jitter_noise": 0.01, "router_aux_loss_coef": 0.0, "attention_dropout": 0.0,
             "hidden_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 32000, "torch_dtype": "bfloat16",
             "rope_scaling": {"type": "longrope", "short_mscale": 1.243163121016122,
                              "long_mscale": 1.243163121016122, "original_max_position_embeddings": 4096,
                              "short_factor": [1.0] * 64, "long_factor": [1.0] * 64}}


def test_published_config_is_refused_naming_the_router(tmp_path):
    """The published config (router_jitter_noise 0.01) fails the build, naming the condition; its
    values otherwise agree with HF's PhimoeConfig (16 experts, top 2, heads of 128)."""
    from transformers import PhimoeConfig
    from infc.compiler.contract.errors import SpecError
    values = dict(PUBLISHED)
    (tmp_path / "config.json").write_text(json.dumps(values))
    with pytest.raises(SpecError, match="jitter == 0"):
        compile_model(model_dir=str(tmp_path), check_checkpoint=False)
    # the rest binds: the same config with jitter 0 and no longrope builds what HF builds
    plain = {k: v for k, v in values.items() if k != "rope_scaling"}
    plain["router_jitter_noise"] = 0.0
    (tmp_path / "config.json").write_text(json.dumps(plain))
    _, plan = compile_model(model_dir=str(tmp_path), check_checkpoint=False)
    hf = PhimoeConfig(**{k: v for k, v in plain.items() if k not in ("architectures", "model_type")})
    c = plan["config"]
    assert c["D"] == hf.hidden_size // hf.num_attention_heads == 128
    assert (c["E"], c["F"], c["L"], c["V"], c["Hkv"], c["swa"], c["attn_bias"], c["lm_bias"]) == \
        (hf.num_local_experts, hf.intermediate_size, hf.num_hidden_layers, hf.vocab_size,
         hf.num_key_value_heads, hf.sliding_window, hf.attention_bias, hf.lm_head_bias)
    assert hf.num_experts_per_tok == 2
    # longrope: refused by the rope op, naming it
    (tmp_path / "config.json").write_text(json.dumps({**values, "router_jitter_noise": 0.0, "num_hidden_layers": 2}))
    with pytest.raises(SpecError, match="longrope"):
        compile_model(model_dir=str(tmp_path), check_checkpoint=False)


def test_config_defaults_are_hf(models, tmp_path):
    """A config.json without the optional keys binds to HF's PhimoeConfig defaults (8 KV heads,
    16 experts, eps 1e-5, no biases, no window, jitter 0.01, which is refused) -- so the check
    gives router_jitter_noise 0 and reads the rest."""
    from transformers import PhimoeConfig
    from infc.compiler.contract.errors import SpecError
    d, _ = models["tiny"]
    c = json.loads((d / "config.json").read_text())
    keep = ("architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
            "num_hidden_layers", "num_attention_heads")
    cfg = {k: c[k] for k in keep}
    cfg["num_attention_heads"] = 8      # a multiple of HF's default 8 KV heads
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SpecError, match="jitter == 0"):
        compile_model(model_dir=str(tmp_path), check_checkpoint=False)
    cfg["router_jitter_noise"] = 0.0
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    _, plan = compile_model(model_dir=str(tmp_path), check_checkpoint=False)
    hf = PhimoeConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    got = plan["config"]
    assert (got["Hkv"], got["E"], got["eps"], got["attn_bias"], got["lm_bias"], got["swa"], got["tie"],
            got["theta"], got["max_len"]) == \
        (hf.num_key_value_heads, hf.num_local_experts, hf.rms_norm_eps, hf.attention_bias, hf.lm_head_bias,
         hf.sliding_window, hf.tie_word_embeddings, hf.rope_parameters["rope_theta"],
         hf.max_position_embeddings)


# -- through the generated kernels (interpreted) ---------------------------------------------------

@pytest.mark.parametrize("fuse", [True, pytest.param(False, marks=EXHAUSTIVE)], ids=["fused", "no-fuse"])
def test_through_kernels(models, fuse, tmp_path):
    check_kernels(*models["tiny"], tmp_path, fuse)
