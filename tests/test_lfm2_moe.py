"""LFM2-MoE (specs/lfm2_moe.yaml: Lfm2MoeForCausalLM) against transformers' own model.

Two tiny random float32 checkpoints made by transformers and saved with save_pretrained (its default
writes each expert's w1 / w3 / w2 as its own tensor, the published layout): hidden 96, gated
short-conv layers (conv_L_cache 3) and GQA layers of 6 q / 2 kv heads of 16 with per-head q/k
RMSNorms, layer_types conv, attention, conv, attention, 8 SwiGLU experts of 40, top 3:
  bias:  the published form: use_expert_bias (the f32 choice bias, random), norm_topk_prob,
         routed_scaling_factor 2.5, the first layer dense (intermediate 64), conv biases on,
         lm_head tied, config.json rewritten into the published form (tie_embedding, rope_theta at
         the top level)
  plain: no expert bias, not renormalized, unscaled, the first two layers dense, no conv biases,
         lm_head untied
Every norm weight is 1 + 0.3 N(0, 1), every bias 0.1 N(0, 1), the expert bias 0.3 N(0, 1), the
router 3x HF's init (HF's norms init to 1, its biases and the expert bias to 0).

The reference executor must give HF's (eager, float32) logits at every position of a 24-token prompt
within 1e-4 (as 24 prefixes in one step, and one token a step) and the same 16 greedy tokens as
generate(); the generated kernels under the interpreter, fused and --no-fuse, follow the reference;
each distinctive feature taken out of the spec moves the logits away from HF's; the published
variant agrees with Lfm2MoeConfig.
"""
import json

import numpy as np
import pytest
import torch

from infc.compiler.build import compile_model
from infc.compiler.contract import caches
from infc.runtime.reference.executor import ReferenceExecutor, SeqChunk

from exhaustive import EXHAUSTIVE
from families import hf_greedy, hf_logits, plan_and_weights, reference_greedy, tiny_hf
from interp_protocol import bf16_tolerance, executors, sequences, through_kernels
from test_qwen3_next import assert_break_bites, assert_logits

VOCAB = 320
PROMPT = [int(t) for t in np.random.default_rng(19).integers(0, VOCAB, 24)]
E, K, FE = 8, 3, 40
BASE = dict(vocab_size=VOCAB, hidden_size=96, intermediate_size=64, moe_intermediate_size=FE,
            num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=2, norm_eps=1e-5,
            num_experts=E, num_experts_per_tok=K, conv_L_cache=3, max_position_embeddings=256,
            initializer_range=0.05, layer_types=["conv", "full_attention"] * 2,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
VARIANTS = {
    "bias": dict(use_expert_bias=True, norm_topk_prob=True, routed_scaling_factor=2.5, num_dense_layers=1,
                 conv_bias=True, tie_word_embeddings=True),
    "plain": dict(use_expert_bias=False, norm_topk_prob=False, routed_scaling_factor=1.0, num_dense_layers=2,
                  conv_bias=False, tie_word_embeddings=False),
}
SCHEDULES = {"bias": ["conv_dense", "attention_moe", "conv_moe", "attention_moe"],
             "plain": ["conv_dense", "attention_dense", "conv_moe", "attention_moe"]}


def randomize(model, seed=7):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            r = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.3 * r)
            elif name.endswith("expert_bias"):
                p.copy_(0.3 * r)
            elif name.endswith(".bias"):
                p.copy_(0.1 * r)
            elif name.endswith("feed_forward.gate.weight"):
                p.copy_(0.15 * r)


def make(kind, d):
    from transformers import Lfm2MoeConfig, Lfm2MoeForCausalLM
    model = tiny_hf(Lfm2MoeForCausalLM, Lfm2MoeConfig, {**BASE, **VARIANTS[kind]},
                    d, 4321, randomize=randomize)
    if kind == "bias":                  # the published config.json's form
        c = json.loads((d / "config.json").read_text())
        c["tie_embedding"] = c.pop("tie_word_embeddings")
        c["rope_theta"] = c.pop("rope_parameters")["rope_theta"]
        (d / "config.json").write_text(json.dumps(c, indent=2))
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for kind in VARIANTS:
        d = tmp_path_factory.mktemp(f"lfm2_moe-{kind}")
        out[kind] = (d, make(kind, d))
    return out


# -- the spec against transformers ----------------------------------------------------------------

def test_checkpoint_names_and_plan(models):
    """The per-expert w1/w3/w2 names, the expert-bias buffer (with use_expert_bias only), the conv
    weight [H, 1, Lc]; the plan's kinds are HF's layer types x dense/MoE, the conv state a slot cache
    of the conv layers, lm_head tied from tie_embedding."""
    from safetensors import safe_open
    for kind, (d, hf) in models.items():
        with safe_open(d / "model.safetensors", "pt") as f:
            names = set(f.keys())
            assert f.get_slice("model.layers.0.conv.conv.weight").get_shape() == [96, 1, 3]
        assert f"model.layers.3.feed_forward.experts.{E - 1}.w2.weight" in names
        assert ("model.layers.3.feed_forward.expert_bias" in names) == (kind == "bias")
        assert ("model.layers.0.conv.conv.bias" in names) == (kind == "bias")
        assert "model.embedding_norm.weight" in names
        plan, _ = plan_and_weights(d)
        schedule = next(e for e in plan["programs"]["decode"] if "repeat" in e)["schedule"]
        hf_kinds = [("conv" if t == "conv" else "attention") + ("_moe" if hasattr(l.feed_forward, "gate") else "_dense")
                    for t, l in zip(hf.config.layer_types, hf.model.layers)]
        assert schedule == hf_kinds == SCHEDULES[kind]
        decl = caches.of_plan(plan)            # the cache contract's reading of the plan
        assert decl["conv"]["kind"] == "slot" and decl["conv"]["layers"] == [0, 2]
        assert decl["k"]["layers"] == [1, 3]
        assert ("tied" in plan["weights"]["lm_head"]["source"]) == (kind == "bias")
        if kind == "bias":
            assert plan["weights"]["expert_bias"]["dtype"] == "f32"


@pytest.mark.parametrize("kind", list(VARIANTS))
def test_logits_and_greedy_match_hf(models, kind):
    d, hf = models[kind]
    want = hf_logits(hf, PROMPT)
    plan, weights = plan_and_weights(d)
    assert_logits(plan, weights, want, PROMPT)
    assert np.abs(want[1:] - want[:-1]).max() > 0.1
    greedy = hf_greedy(hf, PROMPT, 16, 0)
    assert reference_greedy(plan, weights, PROMPT, 16) == greedy


def test_fused_expert_layout_reads(models, tmp_path):
    """A save_original_format=False checkpoint (experts.gate_up_proj / experts.down_proj) reads
    through the experts' `or:` layout and gives the same logits."""
    d, hf = models["bias"]
    fused = tmp_path / "fused"
    hf.save_pretrained(fused, save_original_format=False)
    from safetensors import safe_open
    with safe_open(fused / "model.safetensors", "pt") as f:
        assert "model.layers.1.feed_forward.experts.gate_up_proj" in set(f.keys())
    plan, weights = plan_and_weights(fused)
    got = ReferenceExecutor(plan, weights).step([SeqChunk(0, PROMPT, 0)])
    assert np.abs(got[0] - hf_logits(hf, PROMPT)[-1]).max() <= 1e-4


def test_the_router_features_bite_in_hf(models):
    """What the checks rest on: on this prompt the expert bias changes HF's choices (it is no
    near-zero buffer), the chosen sigmoid scores sum far from 1 (renormalizing shows)."""
    _, hf = models["bias"]
    seen = []
    layer = hf.model.layers[1].feed_forward
    hook = layer.register_forward_hook(lambda m, a, o: seen.append(a[0].reshape(-1, 96)))
    hf_logits(hf, PROMPT)
    hook.remove()
    with torch.no_grad():
        s = torch.sigmoid(seen[0] @ layer.gate.weight.T)
        biased = (s + layer.expert_bias).topk(K, -1).indices.sort(-1).values
        plain = s.topk(K, -1).indices.sort(-1).values
        chosen = s.gather(1, biased).sum(-1)
    assert (biased != plain).any(-1).sum() >= 3
    assert (chosen - 1).abs().min() > 0.1


BREAKS = {   # feature -> (variant, old spec text, the text that takes it out)
    "expert_bias": ("bias", ', bias=expert_bias, norm_eps=reps)', ', norm_eps=reps)'),
    "sigmoid_scores": ("plain", 'scoring="sigmoid", ', ''),
    "routed_scaling": ("bias", "scale=rsf, ", ""),
    "renormalize": ("bias", 'K, norm_topk, scale=rsf, scoring="sigmoid", bias=expert_bias, norm_eps=reps)',
                    'K, not norm_topk, scale=rsf, scoring="sigmoid", bias=expert_bias)'),
    "qk_norm": ("bias", "q = rms_norm(view(linear(h, wq), [T, Hq, D]), q_norm, eps)", "q = view(linear(h, wq), [T, Hq, D])"),
    # B and C swapped: C gating the conv's input, B its output
    "conv_gates": ("plain", "mul(cc, causal_conv1d(mul(cb, cx)", "mul(cb, causal_conv1d(mul(cc, cx)"),
    "conv_bias": ("bias", "conv_w, conv_b, activation", "conv_w, activation"),
    "final_norm": ("plain", "rms_norm(last(x), final_norm, eps)", "last(x)"),
}
FAST_BREAKS = ("expert_bias", "routed_scaling", "conv_gates", "qk_norm")


@pytest.mark.parametrize("feature", [f if f in FAST_BREAKS else pytest.param(f, marks=EXHAUSTIVE) for f in BREAKS])
def test_feature_taken_out_moves_logits(models, feature, tmp_path):
    kind, old, new = BREAKS[feature]
    assert_break_bites(*models[kind], "lfm2_moe.yaml", old, new, tmp_path, prompt=PROMPT)


# -- configs ---------------------------------------------------------------------------------------

def test_published_variant_agrees_with_hf():
    """The variant builds with no weights; its kinds, head dim, tying, router options are what
    Lfm2MoeConfig derives from the same values (tie_embedding read as HF reads it)."""
    from transformers import Lfm2MoeConfig
    from infc.compiler.spec import SPECS_DIR, load_spec
    values = dict(load_spec(SPECS_DIR / "lfm2_moe.yaml").variants["lfm2-8b-a1b"])
    _, plan = compile_model("lfm2-8b-a1b")
    hf = Lfm2MoeConfig(**{k: v for k, v in values.items() if k not in ("architectures", "model_type")})
    schedule = next(e for e in plan["programs"]["decode"] if "repeat" in e)["schedule"]
    assert schedule == [("conv" if t == "conv" else "attention") + ("_dense" if i < hf.num_dense_layers else "_moe")
                        for i, t in enumerate(hf.layer_types)]
    assert schedule.count("attention_moe") == 6 and schedule[:2] == ["conv_dense"] * 2
    c = plan["config"]
    assert c["D"] == hf.hidden_size // hf.num_attention_heads == 64
    assert (c["tie"], c["E"], c["K"], c["Fe"], c["F"], c["rsf"], c["norm_topk"], c["expert_bias_on"],
            c["Lc"], c["theta"], c["eps"]) == \
        (hf.tie_word_embeddings, hf.num_experts, hf.num_experts_per_tok, hf.moe_intermediate_size,
         hf.intermediate_size, hf.routed_scaling_factor, hf.norm_topk_prob, hf.use_expert_bias,
         hf.conv_L_cache, hf.rope_parameters["rope_theta"], hf.norm_eps)
    assert plan["weights"]["lm_head"]["source"] == {"tied": "embed"}


def test_config_defaults_are_hf(models, tmp_path):
    """A config.json with only layer_types and the sizes binds to Lfm2MoeConfig's defaults."""
    from transformers import Lfm2MoeConfig
    c = json.loads((models["plain"][0] / "config.json").read_text())
    cfg = {k: c[k] for k in ("architectures", "model_type", "vocab_size", "num_hidden_layers", "layer_types")}
    cfg["hidden_size"] = 2048          # HF's default heads (32 q / 8 kv) need a width they divide
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    _, plan = compile_model(model_dir=str(tmp_path), check_checkpoint=False)
    hf = Lfm2MoeConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    got = plan["config"]
    assert (got["Hq"], got["Hkv"], got["F"], got["Fe"], got["eps"], got["theta"], got["tie"], got["conv_bias"],
            got["Lc"], got["n_dense"], got["E"], got["K"], got["expert_bias_on"], got["rsf"], got["norm_topk"],
            got["max_len"]) == \
        (hf.num_attention_heads, hf.num_key_value_heads, hf.intermediate_size, hf.moe_intermediate_size,
         hf.norm_eps, hf.rope_parameters["rope_theta"], hf.tie_word_embeddings, hf.conv_bias, hf.conv_L_cache,
         hf.num_dense_layers, hf.num_experts, hf.num_experts_per_tok, hf.use_expert_bias,
         hf.routed_scaling_factor, hf.norm_topk_prob, hf.max_position_embeddings)


# -- through the generated Triton kernels, interpreted -------------------------------------------

@pytest.mark.parametrize("kind,fuse", [("bias", True),
                                       pytest.param("bias", False, marks=EXHAUSTIVE),
                                       pytest.param("plain", True, marks=EXHAUSTIVE),
                                       pytest.param("plain", False, marks=EXHAUSTIVE)],
                         ids=["bias-fused", "bias-no-fuse", "plain-fused", "plain-no-fuse"])
def test_through_kernels(models, kind, fuse, tmp_path):
    d, hf = models[kind]
    plan, run, ref = executors(d, tmp_path / "art", fuse)
    a, b = sequences(VOCAB)
    through_kernels(plan, run, ref, a, b, bf16_tolerance(hf))
