"""Hy3-preview (specs/hy_v3.yaml: HYV3ForCausalLM) against transformers' own model: tiny random
float32 checkpoints made by transformers and saved with save_pretrained (its default
save_original_format=True: the published names mlp.router.gate.weight, mlp.expert_bias,
mlp.shared_mlp.*, mlp.experts.{e}.*), hidden 96, 4 query heads over 2 KV heads of head_dim 32
(not hidden / heads), per-head q/k RMSNorm, 8 routed experts:
  preview: Hy3-preview's form: no biases, layer 0 dense (HF's default mlp_layer_types), top-2,
           router_scaling_factor 2.826, one shared expert
  biased:  attention_bias and mlp_bias (q/k/v/o, the dense MLP's and the shared experts'
           biases), mlp_layer_types sparse, dense, sparse; top-3, router_scaling_factor 1.7, two
           shared experts
Every RMSNorm weight, every bias and the expert bias (large enough to move the choices) are random
(HF initializes them to 1, 0 and 0).

The reference executor gives HF's (eager, float32) logits at every position of a 24-token prompt
within 1e-4, as 24 prefixes in one step and one token per step, and the same 16 greedy tokens as
generate(); the generated kernels under the interpreter (TRITON_INTERPRET=1), fused and --no-fuse,
match the reference; each distinctive feature (the expert bias, the renormalization + scale, the
q/k norms, the shared experts) moves the logits when taken out of the spec.
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

BASE = dict(vocab_size=VOCAB, hidden_size=96, intermediate_size=128, moe_intermediate_size=32,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            num_experts=8, rms_norm_eps=1e-5, max_position_embeddings=512, initializer_range=0.08,
            tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
VARIANTS = {
    "preview": dict(num_experts_per_tok=2, router_scaling_factor=2.826, num_shared_experts=1),
    "biased": dict(num_experts_per_tok=3, router_scaling_factor=1.7, num_shared_experts=2,
                   attention_bias=True, mlp_bias=True, mlp_layer_types=["sparse", "dense", "sparse"]),
}


def randomize(model, seed=7):
    """Every norm weight 1 + 0.3 N(0, 1), every bias 0.1 N(0, 1), every expert bias 0.5 N(0, 1):
    large against the sigmoid scores' spread, so it moves choices."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        for layer in model.model.layers:
            b = getattr(layer.mlp, "e_score_correction_bias", None)
            if b is not None:
                b.copy_(0.5 * torch.randn(b.shape, generator=gen))


def make(kind: str, d, **over):
    from transformers import HYV3Config, HYV3ForCausalLM
    return tiny_hf(HYV3ForCausalLM, HYV3Config, {**BASE, **VARIANTS[kind], **over},
                   d, 4331, randomize=randomize)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_all(tmp_path_factory, "hy_v3", VARIANTS, make)


def test_published_names_and_layer_kinds(models):
    """The checkpoint has the published names (router.gate, expert_bias, shared_mlp, per-expert
    projections) and the plan reads them: the layer kinds follow mlp_layer_types (HF's default:
    layer 0 dense), the expert bias is f32, the routers sigmoid-scored with the bias."""
    for kind, (d, _) in models.items():
        names = set(checkpoint_tensors(d))
        moe = 2 if kind == "preview" else 0
        assert f"model.layers.{moe}.mlp.router.gate.weight" in names
        assert f"model.layers.{moe}.mlp.expert_bias" in names
        assert f"model.layers.{moe}.mlp.shared_mlp.down_proj.weight" in names
        assert f"model.layers.{moe}.mlp.experts.7.gate_proj.weight" in names
        assert not any("gate_up_proj" in n or "e_score_correction_bias" in n or "shared_experts" in n
                       for n in names)
        assert ("model.layers.0.self_attn.o_proj.bias" in names) == (kind == "biased")
        plan, _ = plan_and_weights(d)
        repeat = next(e for e in plan["programs"]["decode"] if "repeat" in e)
        want = ["dense", "sparse", "sparse"] if kind == "preview" else ["sparse", "dense", "sparse"]
        assert repeat["schedule"] == want, kind
        assert plan["weights"]["router_bias"]["dtype"] == "f32"
        assert plan["weights"]["router_bias"]["layers"] == [i for i, k in enumerate(want) if k == "sparse"]
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


def test_in_memory_layout_reads_the_same(models, tmp_path):
    """A save_original_format=False checkpoint (transformers' in-memory names: mlp.gate.weight,
    mlp.e_score_correction_bias, mlp.shared_experts.*, fused experts.gate_up_proj) is read through
    the spec's `or:` layouts and gives the same logits."""
    d, hf = models["biased"]
    hf.save_pretrained(tmp_path, save_original_format=False)
    names = set(checkpoint_tensors(tmp_path))
    assert "model.layers.0.mlp.e_score_correction_bias" in names
    assert "model.layers.0.mlp.experts.gate_up_proj" in names
    plan, weights = plan_and_weights(tmp_path)
    assert_logits(plan, weights, hf_logits(hf, PROMPT), PROMPT)


def test_checkpoint_with_mtp_layer_builds(models, tmp_path):
    """The published checkpoint carries its multi-token-prediction layer as model.layers.80.* (HF's
    _keys_to_ignore_on_load_unexpected): the spec's `ignore:` lets a checkpoint with such tensors
    build, with the same logits (the names inside the layer here are stand-ins)."""
    from test_spec_mtp import _save
    d, hf = models["preview"]
    t, c = checkpoint_tensors(d), json.loads((d / "config.json").read_text())
    H = BASE["hidden_size"]
    t["model.layers.80.input_layernorm.weight"] = np.ones(H, np.float32)
    t["model.layers.80.eh_proj.weight"] = np.zeros((H, 2 * H), np.float32)
    _save(tmp_path, t, c)
    plan, weights = plan_and_weights(tmp_path)
    assert_logits(plan, weights, hf_logits(hf, PROMPT), PROMPT)


# -- each feature bites: the spec with it taken out is far from HF ---------------------------------

BREAKS = {
    # the expert bias only chooses: dropped, other experts are chosen
    "expert_bias": (', scoring="sigmoid", bias=router_bias)', ', scoring="sigmoid")'),
    # the chosen scores renormalized (HF always does)
    "renormalize": ("moe_route(linear(h, router), K, true,", "moe_route(linear(h, router), K, false,"),
    # router_scaling_factor on the weights
    "scale": ("K, true, scale=rsf,", "K, true,"),
    # the per-head q norm before RoPE
    "q_norm": ("q = rms_norm(view(linear(h, wq, bias=bq), [T, Hq, D]), q_norm, eps)",
               "q = view(linear(h, wq, bias=bq), [T, Hq, D])"),
    # the shared experts
    "shared": ("add(moe_experts(h, topw, topi, we_gate, we_up, we_down), shared)",
               "moe_experts(h, topw, topi, we_gate, we_up, we_down)"),
}


def broken_logits(d, tmp_path, old, new, family="hy_v3"):
    """The reference's logits of the model in d under specs/<family>.yaml with `old` replaced by
    `new` everywhere (it must occur); the checkpoint is not checked against the broken plan (a
    weight it no longer reads is fine)."""
    from infc.compiler.contract.safetensors_io import Checkpoint
    from infc.compiler.spec import SPECS_DIR
    from infc.runtime.reference.executor import ReferenceExecutor, SeqChunk
    from infc.runtime.weights.load import load_weights
    text = (SPECS_DIR / f"{family}.yaml").read_text()
    assert old in text, old
    spec = tmp_path / f"{family}.yaml"
    spec.write_text(text.replace(old, new))
    _, plan = compile_model(model_dir=str(d), spec_path=str(spec), check_checkpoint=False)
    weights = load_weights(plan, Checkpoint(d))
    return ReferenceExecutor(plan, weights).step([SeqChunk(0, PROMPT, 0)])


@pytest.mark.parametrize("feature", list(BREAKS))
def test_each_feature_bites(models, feature, tmp_path):
    d, hf = models["biased" if feature == "shared" else "preview"]
    want = hf_logits(hf, PROMPT)[-1]
    got = broken_logits(d, tmp_path, *BREAKS[feature])[0]
    assert np.abs(got - want).max() > 1e-2, feature


# -- configs -----------------------------------------------------------------------------------------

def test_published_variant_agrees_with_hf():
    """The variant (published config.json values, no weights) builds, and what the plan derives
    agrees with what transformers derives from the same values: the dense / sparse layer kinds,
    the head dim, the shared experts' width, the router's scale, theta."""
    from transformers import HYV3Config
    from infc.compiler.spec import SPECS_DIR, load_spec
    values = dict(load_spec(SPECS_DIR / "hy_v3.yaml").variants["hy3-preview"])
    _, plan = compile_model("hy3-preview")
    hf = HYV3Config(**{k: v for k, v in values.items() if k not in ("architectures", "model_type", "torch_dtype")})
    schedule = next(r for r in plan["programs"]["decode"] if "repeat" in r)["schedule"]
    assert schedule == hf.mlp_layer_types
    c = plan["config"]
    assert (c["D"], c["Hq"], c["Hkv"], c["E"], c["K"], c["F"], c["Fe"]) == \
        (hf.head_dim, hf.num_attention_heads, hf.num_key_value_heads, hf.num_experts,
         hf.num_experts_per_tok, hf.intermediate_size, hf.moe_intermediate_size)
    assert c["Fs"] == hf.moe_intermediate_size * hf.num_shared_experts
    assert c["rsf"] == hf.router_scaling_factor and c["theta"] == hf.rope_parameters["rope_theta"]
    assert c["eps"] == hf.rms_norm_eps and c["tie"] == hf.tie_word_embeddings
    from transformers.models.hy_v3.modeling_hy_v3 import HYV3PreTrainedModel
    assert rf"model\.layers\.{hf.num_hidden_layers}.*" in HYV3PreTrainedModel._keys_to_ignore_on_load_unexpected


def test_config_defaults_are_hf(models, tmp_path):
    """A config.json with only the required keys binds to the values HF's HYV3Config gives the
    others (eps, theta, head_dim, the expert counts and widths, the scale, no biases, untied,
    layer 0 dense)."""
    from transformers import HYV3Config
    cfg = {"architectures": ["HYV3ForCausalLM"], "model_type": "hy_v3", "num_hidden_layers": 3}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    _, plan = compile_model(model_dir=str(tmp_path), check_checkpoint=False)
    hf = HYV3Config(num_hidden_layers=3)
    c = plan["config"]
    assert (c["H"], c["Hq"], c["Hkv"], c["D"], c["F"], c["Fe"], c["E"], c["K"], c["n_shared"], c["rsf"],
            c["V"], c["eps"], c["theta"], c["attn_bias"], c["mlp_bias"], c["tie"], c["act"], c["max_len"]) == \
        (hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim, hf.intermediate_size,
         hf.moe_intermediate_size, hf.num_experts, hf.num_experts_per_tok, hf.num_shared_experts,
         hf.router_scaling_factor, hf.vocab_size, hf.rms_norm_eps, hf.rope_parameters["rope_theta"],
         hf.attention_bias, hf.mlp_bias, hf.tie_word_embeddings, hf.hidden_act, hf.max_position_embeddings)
    schedule = next(r for r in plan["programs"]["decode"] if "repeat" in r)["schedule"]
    assert schedule == hf.mlp_layer_types


# -- through the generated kernels (interpreted) ---------------------------------------------------

def check_kernels(d, hf, tmp_path, fuse):
    """tests/test_families_interp.py's check: a 21-token prefill, a second sequence sharing its
    first page that prefills only its tail, then two batched decode steps (the second through the
    wide program); bf16 kernels within max(2e-2, twice HF's own bf16 error) of the reference."""
    from interp_protocol import bf16_tolerance, executors, sequences, through_kernels
    plan, run, ref = executors(d, tmp_path / "art", fuse)
    a, b = sequences(VOCAB)
    through_kernels(plan, run, ref, a, b, bf16_tolerance(hf))


@pytest.mark.parametrize("kind,fuse", [
    ("biased", True),
    pytest.param("biased", False, marks=EXHAUSTIVE),
    pytest.param("preview", True, marks=EXHAUSTIVE),
    pytest.param("preview", False, marks=EXHAUSTIVE),
], ids=["biased-fused", "biased-no-fuse", "preview-fused", "preview-no-fuse"])
def test_through_kernels(models, kind, fuse, tmp_path):
    check_kernels(*models[kind], tmp_path, fuse)


@pytest.mark.parametrize("over,match", [
    ({"hidden_act": "gelu"}, "requirement 'act == \"silu\"' does not hold"),
    ({"num_shared_experts": 0}, "value of Fs .* must be a positive integer"),   # before n_shared >= 1
])
def test_unsupported_configs_fail_clearly(tmp_path, over, match):
    """A configuration the spec does not cover fails at build, naming what it breaks."""
    from infc.compiler.contract.errors import SpecError
    cfg = {"architectures": ["HYV3ForCausalLM"], "model_type": "hy_v3", "num_hidden_layers": 3, **over}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SpecError, match=match):
        compile_model(model_dir=str(tmp_path), check_checkpoint=False)
