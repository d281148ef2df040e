"""MiniMax-M2 / M2.1 (specs/minimax_m2.yaml: MiniMaxM2ForCausalLM) against transformers' own
model: a tiny random float32 checkpoint made by transformers and saved with save_pretrained (its
default save_original_format=True writes the published layout: block_sparse_moe.experts.{e}.w1/
w2/w3.weight and block_sparse_moe.e_score_correction_bias, not transformers 5's fused
mlp.experts.gate_up_proj), hidden 96, 4 query heads over 2 KV heads of head_dim 32 (not hidden /
heads), rotary_dim 16 (the first 16 dims of each head rotate, rotate-half), q/k RMSNorm over the
whole projected width (128 and 64), three MoE layers of 8 experts, top-2, sigmoid router with a
correction bias. Every RMSNorm and a correction bias large enough to move the choices are random
(HF initializes them to 1 and 0).

The reference executor must give HF's (eager, float32) logits at every position of a 24-token
prompt within 1e-4, as 24 prefixes in one step and one token per step, and the same 16 greedy
tokens as generate(); the generated kernels under the interpreter (TRITON_INTERPRET=1), fused and
--no-fuse, match the reference (tests/test_glm4_moe.py's checks).
"""
import copy
import json

import numpy as np
import pytest
import torch

from infc.compiler.build import compile_model
from infc.runtime.reference.executor import ReferenceExecutor, SeqChunk

from exhaustive import EXHAUSTIVE
from families import (checkpoint_tensors, hf_greedy, hf_logits, plan_and_weights, reference_greedy,
                      tiny_hf)
from test_deepseek_v2 import PROMPT, VOCAB, assert_logits, make_all
from test_glm4_moe import check_kernels, hf_routes

BASE = dict(vocab_size=VOCAB, hidden_size=96, intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, rotary_dim=16,
            num_local_experts=8, num_experts_per_tok=2, rope_theta=10000.0, rms_norm_eps=1e-6,
            max_position_embeddings=512, initializer_range=0.08, tie_word_embeddings=False,
            bos_token_id=1, eos_token_id=2)
VARIANTS = {"m2": {}}


def randomize(model, seed=7):
    """Every norm weight (the layer norms, the whole-width q/k norms, the final norm) 1 + 0.3 N(0, 1),
    every router's correction bias 0.5 N(0, 1): large against the sigmoid scores' spread, so it
    moves choices."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
        for layer in model.model.layers:
            b = layer.mlp.e_score_correction_bias
            b.copy_(0.5 * torch.randn(b.shape, generator=gen))


def make(kind: str, d, **over):
    from transformers import MiniMaxM2Config, MiniMaxM2ForCausalLM
    return tiny_hf(MiniMaxM2ForCausalLM, MiniMaxM2Config, {**BASE, **VARIANTS[kind], **over},
                   d, 4330, randomize=randomize)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_all(tmp_path_factory, "minimax_m2", VARIANTS, make)


def test_published_names_and_plan(models):
    """The checkpoint has the published tensor names (per expert w1/w2/w3 under block_sparse_moe,
    the router and its correction bias there, whole-width q/k norms) and the plan reads them: the
    q/k norms Hq*D and Hkv*D wide, 16 rotary dims of 32, the bias f32, every router sigmoid with
    the bias; no fused expert tensor is stored."""
    d, _ = models["m2"]
    tensors = checkpoint_tensors(d)
    names = set(tensors)
    assert "model.layers.2.block_sparse_moe.experts.7.w1.weight" in names
    assert "model.layers.0.block_sparse_moe.experts.0.w2.weight" in names
    assert "model.layers.1.block_sparse_moe.e_score_correction_bias" in names
    assert "model.layers.1.block_sparse_moe.gate.weight" in names
    assert not any("gate_up_proj" in n or ".mlp." in n for n in names)
    assert tensors["model.layers.0.self_attn.q_norm.weight"].shape == (128,)
    assert tensors["model.layers.0.self_attn.k_norm.weight"].shape == (64,)
    plan, _ = plan_and_weights(d)
    assert plan["config"]["R"] == 16 and plan["config"]["D"] == 32
    assert plan["weights"]["router_bias"]["dtype"] == "f32"
    assert plan["weights"]["router_bias"]["layers"] == [0, 1, 2]
    assert plan["weights"]["q_norm"]["shape"][-1] == 128 and plan["weights"]["k_norm"]["shape"][-1] == 64
    routes = [n for n in json.dumps(plan["programs"]["prefill"]).split('"op": ') if n.startswith('"moe_route')]
    assert routes and all('"scoring": "sigmoid"' in n and '"has_bias": true' in n for n in routes)


@pytest.mark.parametrize("kind", list(VARIANTS))
def test_logits_and_greedy_match_hf(models, kind):
    d, hf = models[kind]
    want = hf_logits(hf, PROMPT)
    plan, weights = plan_and_weights(d)
    assert_logits(plan, weights, want, PROMPT)
    greedy = hf_greedy(hf, PROMPT, 16, VOCAB - 1)
    assert reference_greedy(plan, weights, PROMPT, 16) == greedy


def test_the_correction_bias_bites(models):
    """What the model tests rest on: on this prompt, HF's choices move when the correction bias is
    zeroed (so a spec that lost it would choose differently), and the reference's logits move when
    its correction bias is zeroed."""
    d, hf = models["m2"]
    base = hf_routes(hf, PROMPT)
    other = copy.deepcopy(hf)
    for layer in other.model.layers:
        layer.mlp.e_score_correction_bias.zero_()
    moved = sum(int((a != b).any(-1).sum()) for a, b in zip(base, hf_routes(other, PROMPT)))
    assert moved >= 3, moved
    plan, weights = plan_and_weights(d)
    got = ReferenceExecutor(plan, weights).step([SeqChunk(0, PROMPT, 0)])
    zeroed = dict(weights, router_bias=[np.zeros_like(w) for w in weights["router_bias"]]
                  if isinstance(weights["router_bias"], list) else np.zeros_like(weights["router_bias"]))
    other = ReferenceExecutor(plan, zeroed).step([SeqChunk(0, PROMPT, 0)])
    assert np.abs(got - other).max() > 1e-3


@pytest.mark.parametrize("where", ["rotary_dim", "both", "partial", "neither"])
def test_rotary_dims_are_hfs(models, tmp_path, where):
    """The published config.json gives rotary_dim (64 of 128), transformers 5 writes both it and
    rope_parameters.partial_rotary_factor: the rotary dims are HF's in each case (the factor
    first, then rotary_dim, else the whole head)."""
    from transformers import MiniMaxM2Config
    from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2RotaryEmbedding
    d, _ = models["m2"]
    c = json.loads((d / "config.json").read_text())
    rp = {k: v for k, v in c["rope_parameters"].items() if k != "partial_rotary_factor"}
    cfg = {k: v for k, v in c.items() if k not in ("rotary_dim", "rope_parameters")}
    cfg["rope_theta"] = rp["rope_theta"]
    if where in ("rotary_dim", "both"):
        cfg["rotary_dim"] = 8
    if where in ("partial", "both"):
        cfg["partial_rotary_factor"] = 0.25 if where == "partial" else 0.75
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    _, plan = compile_model(model_dir=str(tmp_path), check_checkpoint=False)
    hf = MiniMaxM2Config(**{k: v for k, v in cfg.items()
                            if k not in ("architectures", "model_type", "transformers_version", "dtype")})
    want = 2 * MiniMaxM2RotaryEmbedding(hf).inv_freq.numel()
    assert plan["config"]["R"] == want == {"rotary_dim": 8, "both": 24, "partial": 8, "neither": 32}[where]


def test_published_variant_agrees_with_hf():
    """The variant (published config.json values, no weights) builds, and what the plan derives
    agrees with what transformers derives from the same values: head and rotary dims, experts,
    top-k, theta, eps; every layer MoE with the sigmoid router."""
    from transformers import MiniMaxM2Config
    from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2RotaryEmbedding
    from infc.compiler.spec import SPECS_DIR, load_spec
    values = dict(load_spec(SPECS_DIR / "minimax_m2.yaml").variants["minimax-m2"])
    _, plan = compile_model("minimax-m2")
    hf = MiniMaxM2Config(**{k: v for k, v in values.items() if k not in ("architectures", "model_type")})
    c = plan["config"]
    assert c["D"] == hf.head_dim == 128
    assert c["R"] == 2 * MiniMaxM2RotaryEmbedding(hf).inv_freq.numel() == 64
    assert (c["E"], c["K"], c["F"], c["L"], c["V"]) == \
        (hf.num_local_experts, hf.num_experts_per_tok, hf.intermediate_size, hf.num_hidden_layers, hf.vocab_size)
    assert (c["theta"], c["eps"]) == (hf.rope_parameters["rope_theta"], hf.rms_norm_eps)
    assert plan["weights"]["router_bias"]["layers"] == list(range(hf.num_hidden_layers))
    assert plan["weights"]["q_norm"]["shape"][-1] == hf.num_attention_heads * hf.head_dim


def test_config_outside_hfs_math_is_refused(models, tmp_path):
    """Keys HF's port does not read but whose published values its math is (per_layer q/k norm,
    sigmoid scoring with the routing bias, no shared expert): another value fails the build,
    naming the condition."""
    from infc.compiler.contract.errors import SpecError
    d, _ = models["m2"]
    c = json.loads((d / "config.json").read_text())
    for key, value in (("qk_norm_type", "per_head"), ("scoring_func", "softmax"),
                       ("use_routing_bias", False), ("shared_intermediate_size", 64)):
        out = tmp_path / key
        out.mkdir()
        (out / "config.json").write_text(json.dumps({**c, key: value}))
        with pytest.raises(SpecError):
            compile_model(model_dir=str(out), check_checkpoint=False)


# -- through the generated kernels (interpreted) ---------------------------------------------------

@pytest.mark.parametrize("kind,fuse", [
    ("m2", True),
    pytest.param("m2", False, marks=EXHAUSTIVE),
], ids=["m2-fused", "m2-no-fuse"])
def test_through_kernels(models, kind, fuse, tmp_path):
    check_kernels(*models[kind], tmp_path, fuse)


def test_narrow_program_through_kernels(models, tmp_path):
    """One sequence's decode steps through the narrow program, then the wide one
    (tests/test_deepseek_v2_interp.py's check): every layer is MoE, whose attention norm merges
    into the qkv GEMV once the second norm's residual has a buffer of its own
    (compiler/passes/merge_prologues.py)."""
    from test_deepseek_v2_interp import check_through_kernels
    plan, _ = plan_and_weights(models["m2"][0])
    assert "narrow" in plan["programs"]
    check_through_kernels(*models["m2"], tmp_path)
