"""GLM-4.7-Flash (Glm4MoeLiteForCausalLM, model_type glm4_moe_lite), bound by specs/deepseek_v2.yaml:
transformers 5's port is DeepSeek-V3's MLA attention (q_lora, interleaved RoPE) with GLM-4.5's
router (sigmoid scores, a correction bias that chooses, groups, norm_topk_prob,
routed_scaling_factor) and a shared expert, the dense and MoE layers chosen by the config's
`mlp_layer_types` list rather than first_k_dense_replace. Tiny random float32 checkpoints made by
transformers (v_head_dim != qk_nope_head_dim, 4 groups of which the best 2 are kept, a correction
bias large enough to move choices): the reference executor's logits equal HF's at every position
within 1e-4 and the 16 greedy tokens are generate()'s, for the default layer pattern (dense first)
and one where a dense layer follows a MoE one; an unknown layer type fails naming it."""
import json

import pytest
import torch

from infc.compiler.build import compile_model
from infc.compiler.contract.errors import SpecError

from families import hf_greedy, plan_and_weights, reference_greedy, tiny_hf
from test_deepseek_v2 import PROMPT, VOCAB, assert_logits, make_all
from test_deepseek_v3 import randomize_v3

BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=24,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24,
            kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=20,
            n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=3, n_group=4,
            topk_group=2, norm_topk_prob=True, routed_scaling_factor=1.8, rms_norm_eps=1e-5,
            max_position_embeddings=512, initializer_range=0.08, tie_word_embeddings=False)
VARIANTS = {"default": {}, "pattern": dict(mlp_layer_types=["sparse", "dense", "sparse"])}


def make(kind, d):
    from transformers import Glm4MoeLiteConfig, Glm4MoeLiteForCausalLM
    return tiny_hf(Glm4MoeLiteForCausalLM, Glm4MoeLiteConfig, {**BASE, **VARIANTS[kind]},
                   d, 4747, randomize=lambda m: randomize_v3(m, m.model.layers))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_all(tmp_path_factory, "glm4_moe_lite", VARIANTS, make)


@pytest.mark.parametrize("kind", list(VARIANTS))
def test_logits_and_greedy_match_hf(models, kind):
    d, hf = models[kind]
    config = json.loads((d / "config.json").read_text())
    assert config["model_type"] == "glm4_moe_lite" and "first_k_dense_replace" not in config
    plan, weights = plan_and_weights(d)
    dense = [i for i, t in enumerate(config["mlp_layer_types"]) if t == "dense"]
    assert plan["weights"]["wd"]["layers"] == dense            # the dense MLP's layers
    assert plan["weights"]["router"]["layers"] == [i for i in range(3) if i not in dense]
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([PROMPT])).logits[0].float().numpy()
    assert_logits(plan, weights, want, PROMPT)
    greedy = hf_greedy(hf, PROMPT, 16, VOCAB - 1)
    assert reference_greedy(plan, weights, PROMPT, 16) == greedy


def test_unknown_layer_type_is_named(models, tmp_path):
    d, _ = models["default"]
    c = json.loads((d / "config.json").read_text())
    bad = tmp_path / "m"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**c, "mlp_layer_types": ["dense", "moe", "sparse"]}))
    with pytest.raises(SpecError, match="mlp_layer_types moe"):
        compile_model(model_dir=str(bad))
