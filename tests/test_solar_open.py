"""Solar-Open (SolarOpenForCausalLM, model_type solar_open), bound by specs/glm4_moe.yaml: GLM-4.5's
MoE block (DeepSeek-V3's router, a shared expert) under Llama's attention, every layer MoE, full
RoPE. Its config.json carries no first_k_dense_replace, use_qk_norm, partial_rotary_factor or
intermediate_size: the spec's defaults for them follow model_type (GLM-4.5's would make layer 0
dense and rotate half of each head). A tiny random float32 checkpoint made by transformers (q/k/v
biases, 4 groups of which 2 are kept, a correction bias that moves choices): every position within
1e-4 of HF, 16 greedy tokens as generate(), and through the interpreted kernels."""
import json

import pytest
import torch

from exhaustive import EXHAUSTIVE
from families import checkpoint_tensors, hf_greedy, hf_logits, plan_and_weights, reference_greedy
from test_deepseek_v2 import PROMPT, VOCAB, assert_logits
from test_glm4_moe import check_kernels, randomize

CONFIG = dict(vocab_size=VOCAB, hidden_size=96, moe_intermediate_size=32, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=32, n_routed_experts=8,
              n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
              norm_topk_prob=True, routed_scaling_factor=2.5, attention_bias=True,
              rms_norm_eps=1e-5, max_position_embeddings=512, initializer_range=0.08,
              tie_word_embeddings=False)


@pytest.fixture(scope="module")
def solar(tmp_path_factory):
    from transformers import SolarOpenConfig, SolarOpenForCausalLM
    torch.manual_seed(4331)
    model = SolarOpenForCausalLM(SolarOpenConfig(**CONFIG)).float().eval()
    model.set_attn_implementation("eager")
    randomize(model)
    d = tmp_path_factory.mktemp("solar_open")
    model.save_pretrained(d)
    return d, model


def test_config_defaults_follow_model_type(solar):
    d, _ = solar
    config = json.loads((d / "config.json").read_text())
    assert config["model_type"] == "solar_open"
    assert not {"first_k_dense_replace", "use_qk_norm", "partial_rotary_factor",
                "intermediate_size"} & set(config)
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in set(checkpoint_tensors(d))
    plan, _ = plan_and_weights(d)
    assert plan["config"]["R"] == plan["config"]["D"] == 32
    repeat = next(e for e in plan["programs"]["decode"] if "repeat" in e)
    assert repeat["schedule"] == ["moe"] * 3


def test_logits_and_greedy_match_hf(solar):
    d, hf = solar
    plan, weights = plan_and_weights(d)
    assert_logits(plan, weights, hf_logits(hf, PROMPT), PROMPT)
    greedy = hf_greedy(hf, PROMPT, 16, VOCAB - 1)
    assert reference_greedy(plan, weights, PROMPT, 16) == greedy


@EXHAUSTIVE          # glm4_moe's kernels at full rotary: every Llama's; here for the whole model
def test_through_kernels(solar, tmp_path):
    check_kernels(*solar, tmp_path, True)
