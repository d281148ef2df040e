"""IBM Granite 3.x MoE (specs/granitemoe.yaml: GraniteMoeForCausalLM) against transformers' own
model: tiny random float32 checkpoints made by transformers and saved with save_pretrained (its
default save_original_format=True writes the published layout: block_sparse_moe.input_linear /
output_linear [E, 2F, H] / [E, H, F] and block_sparse_moe.router.layer.weight, not transformers
5's experts.gate_up_proj), hidden 96, 3 query heads over 1 KV head of 32, 8 experts of width 32,
two layers, Granite's four scalars away from 1 (and the softmax scale away from both head_dim^-1/2
and 1 / head_dim):
  g30:  Granite-3.0's form: tied lm_head, no attention biases, top-2; config.json rewritten into
        the published (transformers 4.x) form, rope_theta at its top level (not 10000, so the
        fallback binding bites)
  bias: attention biases on q/k/v/o (published: off; o's is scaled by residual_multiplier too),
        an untied lm_head, top-3, other multipliers, transformers 5's rope_parameters
Every RMSNorm weight and bias is random (HF initializes them to 1 and 0).

The reference executor must give HF's (eager, float32) logits at every position of a 24-token
prompt within 1e-4, as 24 prefixes in one step and one token a step, and the same 16 greedy
tokens as generate(); the generated kernels under the interpreter (TRITON_INTERPRET=1), fused and
--no-fuse, match the reference (tests/test_glm4_moe.py's checks; the narrow program with
--exhaustive); the same model saved with save_original_format=False builds through the `or:`
layouts and gives the same logits. Each Granite-specific piece
(the four scalars, the residual multiplier on each sublayer, the top-k-then-softmax router, the
gate | up order inside input_linear) is broken in a copy of the spec and must move the logits
away from HF's. GraniteMoeShared (the same spec) has tests/test_granitemoeshared.py.
"""
import json

import numpy as np
import pytest
import torch

from infc.compiler.build import compile_model
from infc.runtime.reference.executor import ReferenceExecutor, SeqChunk

from exhaustive import EXHAUSTIVE
from families import (checkpoint_tensors, hf_greedy, hf_logits, plan_and_weights, reference_greedy,
                      tiny_hf)
from test_deepseek_v2 import PROMPT, TOL, VOCAB, assert_logits, make_all
from test_glm4_moe import check_kernels

BASE = dict(vocab_size=VOCAB, hidden_size=96, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=3, num_key_value_heads=1, num_local_experts=8, rms_norm_eps=1e-6,
            max_position_embeddings=256, initializer_range=0.08, bos_token_id=1, eos_token_id=2)
VARIANTS = {
    "g30": dict(num_experts_per_tok=2, tie_word_embeddings=True, attention_bias=False,
                embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.05,
                logits_scaling=2.5, rope_parameters={"rope_type": "default", "rope_theta": 1000.0}),
    "bias": dict(num_experts_per_tok=3, tie_word_embeddings=False, attention_bias=True,
                 embedding_multiplier=6.0, residual_multiplier=0.35, attention_multiplier=0.08,
                 logits_scaling=1.5, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
}
LEGACY = {"g30"}            # config.json rewritten into the published form (rope_theta at the top)


def randomize(model, seed=7):
    """Every norm weight 1 + 0.3 N(0, 1), every bias 0.1 N(0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))


def legacy_config(d):
    """d's config.json in the published (transformers 4.x) form: rope_theta / rope_scaling at the
    top level, no rope_parameters."""
    path = d / "config.json"
    c = json.loads(path.read_text())
    rp = dict(c.pop("rope_parameters"))
    c["rope_theta"] = rp.pop("rope_theta")
    c["rope_scaling"] = rp if rp.get("rope_type", "default") != "default" else None
    path.write_text(json.dumps(c, indent=2, sort_keys=True))


def make(kind: str, d, **over):
    from transformers import GraniteMoeConfig, GraniteMoeForCausalLM
    model = tiny_hf(GraniteMoeForCausalLM, GraniteMoeConfig, {**BASE, **VARIANTS[kind], **over},
                    d, 4330, randomize=randomize)
    if kind in LEGACY:
        legacy_config(d)
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_all(tmp_path_factory, "granitemoe", VARIANTS, make)


def test_published_names_and_plan(models):
    """The checkpoint has the published tensor names (the experts' input_linear [E, 2F, H] and
    output_linear [E, H, F], router.layer, no fused gate_up_proj; lm_head only untied) and the plan
    reads them: every layer the routed kind, gate and up each [E, F, H] out of input_linear, the
    scalars bound from config.json (the g30 theta from the published top-level key)."""
    for kind, (d, hf) in models.items():
        tensors = checkpoint_tensors(d)
        assert tensors["model.layers.1.block_sparse_moe.input_linear.weight"].shape == (8, 64, 96)
        assert tensors["model.layers.1.block_sparse_moe.output_linear.weight"].shape == (8, 96, 32)
        assert tensors["model.layers.0.block_sparse_moe.router.layer.weight"].shape == (8, 96)
        assert not any("gate_up_proj" in n or "experts" in n or "shared_mlp" in n for n in tensors)
        assert ("lm_head.weight" in tensors) == (kind == "bias")
        assert ("model.layers.0.self_attn.o_proj.bias" in tensors) == (kind == "bias")
        plan, _ = plan_and_weights(d)
        repeat = next(e for e in plan["programs"]["decode"] if "repeat" in e)
        assert repeat["schedule"] == ["routed", "routed"]
        c = plan["config"]
        v = VARIANTS[kind]
        assert (c["emb_mult"], c["res_mult"], c["attn_mult"], c["logits_scaling"], c["theta"], c["K"]) == \
            (v["embedding_multiplier"], v["residual_multiplier"], v["attention_multiplier"],
             v["logits_scaling"], v["rope_parameters"]["rope_theta"], v["num_experts_per_tok"])
        assert not c["has_shared"] and c["D"] == 32


@pytest.mark.parametrize("kind", list(VARIANTS))
def test_logits_and_greedy_match_hf(models, kind):
    d, hf = models[kind]
    want = hf_logits(hf, PROMPT)
    plan, weights = plan_and_weights(d)
    assert_logits(plan, weights, want, PROMPT)
    greedy = hf_greedy(hf, PROMPT, 16, VOCAB - 1)
    assert reference_greedy(plan, weights, PROMPT, 16) == greedy


# -- each Granite-specific piece bites: a spec without it is away from HF -----------------------

def spec_text() -> str:
    from infc.compiler.spec import SPECS_DIR
    return (SPECS_DIR / "granitemoe.yaml").read_text()


def broken_logits(d, tmp_path, *changes) -> np.ndarray:
    """The reference's prefill logits of PROMPT for the checkpoint in d under a copy of the spec
    with each change (old, new, count) made: `old`, occurring `count` times, replaced by `new`."""
    from infc.compiler.contract.safetensors_io import Checkpoint
    from infc.runtime.weights.load import load_weights
    text = spec_text()
    for old, new, count in changes:
        assert text.count(old) == count, old
        text = text.replace(old, new)
    path = tmp_path / "granitemoe.yaml"
    path.write_text(text)
    _, plan = compile_model(model_dir=str(d), spec_path=str(path))
    return ReferenceExecutor(plan, load_weights(plan, Checkpoint(d))).step([SeqChunk(0, PROMPT, 0)])


# name -> the spec changes that take away one feature HF's GraniteMoe has
BREAKS = {
    # x * embedding_multiplier after the embedding
    "embedding_multiplier": [("x = mul(embedding(tokens, embed), emb_mult)", "x = embedding(tokens, embed)", 1)],
    # logits / logits_scaling
    "logits_scaling": [("mul(linear(rms_norm(last(x), final_norm, eps), lm_head), inv_logits_scaling)",
                        "linear(rms_norm(last(x), final_norm, eps), lm_head)", 1)],
    # softmax scale attention_multiplier, not head_dim ** -0.5
    "attention_multiplier": [(", v, scale=attn_mult)", ", v)", 2)],
    # residual_multiplier on the attention's output (o_proj, folded) and on the MoE's (the experts' down)
    "residual_multiplier_attention": [("shape: [H, Hq*D], scale: res_mult}", "shape: [H, Hq*D]}", 1)],
    "residual_multiplier_moe": [("experts: E, scale: res_mult,", "experts: E,", 1)],
    # the softmax over the chosen top-k logits (renormalized), not over all E
    "router_renormalizes": [("moe_route(linear(h, router), K, true)", "moe_route(linear(h, router), K, false)", 2)],
    # input_linear's first F rows are the gate, the last F the up projection (HF's chunk(2))
    "gate_up_order": [("experts: E, rows: [0, F],", "experts: E, rows: [@],", 1),
                      ("experts: E, rows: [F, 2*F],", "experts: E, rows: [0, F],", 1),
                      ("rows: [@],", "rows: [F, 2*F],", 1)],
}


@pytest.mark.parametrize("name", list(BREAKS))
def test_each_feature_bites(models, tmp_path, name):
    """The spec as written is within TOL of HF's logits (test_logits_and_greedy_match_hf); with
    one feature taken away the logits are far (> 100 x TOL) from HF's at some position."""
    d, hf = models["g30"]
    got = broken_logits(d, tmp_path, *BREAKS[name])
    assert np.abs(got - hf_logits(hf, PROMPT)).max() > 100 * TOL, name


def test_bias_on_o_proj_is_scaled(models, tmp_path):
    """HF multiplies the attention's whole output, o_proj's bias included, by residual_multiplier:
    the bias variant without the bias's scale is away from HF."""
    d, hf = models["bias"]
    got = broken_logits(d, tmp_path, ("shape: [H], when: attn_bias, scale: res_mult}", "shape: [H], when: attn_bias}", 1))
    assert np.abs(got - hf_logits(hf, PROMPT)).max() > 100 * TOL


def test_fused_layout_builds_and_matches(models, tmp_path):
    """The same model saved with save_original_format=False (transformers 5's in-memory names:
    block_sparse_moe.experts.gate_up_proj / down_proj, router.weight) builds through the `or:`
    layouts and gives the per-expert checkpoint's logits exactly, HF's within TOL."""
    from infc.compiler.contract.safetensors_io import Checkpoint
    from infc.runtime.weights.load import load_weights
    d, hf = models["g30"]
    fused = tmp_path / "fused"
    hf.save_pretrained(fused, save_original_format=False)
    names = set(checkpoint_tensors(fused))
    assert "model.layers.0.block_sparse_moe.experts.gate_up_proj" in names
    assert "model.layers.0.block_sparse_moe.router.weight" in names
    assert not any("input_linear" in n or "router.layer" in n for n in names)
    _, plan = compile_model(model_dir=str(fused))
    sources = json.dumps({k: w["source"] for k, w in plan["weights"].items()})
    assert "experts.gate_up_proj" in sources and "input_linear" not in sources
    chunks = [SeqChunk(k, PROMPT[:k], 0) for k in range(1, len(PROMPT) + 1)]
    got = ReferenceExecutor(plan, load_weights(plan, Checkpoint(fused))).step(chunks)
    want_plan, want_weights = plan_and_weights(d)
    np.testing.assert_array_equal(got, ReferenceExecutor(want_plan, want_weights).step(chunks))
    assert np.abs(got - hf_logits(hf, PROMPT)).max() <= TOL


# -- config.json: published variants, HF's defaults, what the spec refuses ------------------------

@pytest.mark.parametrize("variant", ["granite-3.0-1b-a400m", "granite-3.0-3b-a800m",
                                     "granite-3.1-1b-a400m", "granite-3.1-3b-a800m"])
def test_published_variants_agree_with_hf(variant):
    """Each variant (published config.json values, no weights) builds, and what the plan binds
    agrees with what transformers' GraniteMoeConfig makes of the same values: the shapes, the
    experts and top-k, the four scalars, theta, eps, the tied head; no shared MLP; every layer
    routed."""
    from transformers import GraniteMoeConfig
    from infc.compiler.spec import SPECS_DIR, load_spec
    values = dict(load_spec(SPECS_DIR / "granitemoe.yaml").variants[variant])
    _, plan = compile_model(variant)
    hf = GraniteMoeConfig(**{k: v for k, v in values.items() if k not in ("architectures", "model_type")})
    c = plan["config"]
    assert (c["H"], c["L"], c["Hq"], c["Hkv"], c["D"], c["F"], c["E"], c["K"], c["V"]) == \
        (hf.hidden_size, hf.num_hidden_layers, hf.num_attention_heads, hf.num_key_value_heads,
         hf.hidden_size // hf.num_attention_heads, hf.intermediate_size, hf.num_local_experts,
         hf.num_experts_per_tok, hf.vocab_size)
    assert (c["emb_mult"], c["res_mult"], c["attn_mult"], c["logits_scaling"]) == \
        (hf.embedding_multiplier, hf.residual_multiplier, hf.attention_multiplier, hf.logits_scaling)
    assert c["attn_mult"] == 1 / c["D"]          # muP: 1 / head_dim, as published
    assert (c["theta"], c["eps"], c["tie"], c["attn_bias"], c["act"]) == \
        (hf.rope_parameters["rope_theta"], hf.rms_norm_eps, hf.tie_word_embeddings, hf.attention_bias,
         hf.hidden_act)
    assert not c["has_shared"]
    schedule = next(r for r in plan["programs"]["decode"] if "repeat" in r)["schedule"]
    assert schedule == ["routed"] * hf.num_hidden_layers


def test_config_defaults_are_hf(models, tmp_path):
    """A config.json without the optional keys binds to the values HF's GraniteMoeConfig gives
    them (8 experts, top-2, KV heads = heads, eps 1e-6, theta 10000, the scalars 1, untied, no
    biases, silu)."""
    from transformers import GraniteMoeConfig
    d, _ = models["bias"]
    c = json.loads((d / "config.json").read_text())
    keep = ("architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
            "num_hidden_layers", "num_attention_heads")
    cfg = {k: c[k] for k in keep}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    _, plan = compile_model(model_dir=str(tmp_path), check_checkpoint=False)
    hf = GraniteMoeConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    got = plan["config"]
    assert (got["E"], got["K"], got["Hkv"], got["eps"], got["theta"], got["emb_mult"], got["res_mult"],
            got["attn_mult"], got["logits_scaling"], got["tie"], got["attn_bias"], got["act"],
            got["max_len"]) == \
        (hf.num_local_experts, hf.num_experts_per_tok, hf.num_key_value_heads, hf.rms_norm_eps,
         hf.rope_parameters["rope_theta"], hf.embedding_multiplier, hf.residual_multiplier,
         hf.attention_multiplier, hf.logits_scaling, hf.tie_word_embeddings, hf.attention_bias,
         hf.hidden_act, hf.max_position_embeddings)
    assert not got["has_shared"]


def test_shared_size_in_a_granitemoe_config_is_ignored(models, tmp_path):
    """HF's GraniteMoe builds no shared MLP whatever config.json says (the key is GraniteMoeShared's):
    a GraniteMoeForCausalLM config carrying shared_intermediate_size still builds the routed layers
    from the same checkpoint, and gives HF's logits."""
    import shutil
    d, hf = models["g30"]
    out = tmp_path / "m"
    shutil.copytree(d, out)
    c = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**c, "shared_intermediate_size": 64}))
    from infc.compiler.contract.safetensors_io import Checkpoint
    from infc.runtime.weights.load import load_weights
    _, plan = compile_model(model_dir=str(out))
    assert not plan["config"]["has_shared"]
    got = ReferenceExecutor(plan, load_weights(plan, Checkpoint(out))).step(
        [SeqChunk(k, PROMPT[:k], 0) for k in range(1, len(PROMPT) + 1)])
    assert np.abs(got - hf_logits(hf, PROMPT)).max() <= TOL


def test_the_config_activation_runs_the_experts(tmp_path):
    """HF's experts and shared MLP apply ACT2FN[hidden_act]: with gelu (tanh form), the spec's
    moe_experts(act=act) and act() give HF's logits at every position."""
    d = tmp_path / "gelu"
    hf = make("bias", d, hidden_act="gelu_pytorch_tanh")
    plan, weights = plan_and_weights(d)
    assert '"act": "gelu_pytorch_tanh"' in json.dumps(plan["programs"]["prefill"])
    got = ReferenceExecutor(plan, weights).step([SeqChunk(k, PROMPT[:k], 0) for k in range(1, len(PROMPT) + 1)])
    assert np.abs(got - hf_logits(hf, PROMPT)).max() <= TOL


@pytest.mark.parametrize("key,value,condition", [
    ("model_type", "granitemoe_swa", 'mtype in ["granitemoe", "granitemoeshared"]'),
    ("num_experts_per_tok", 9, "K <= E"),
])
def test_config_outside_the_spec_is_refused(models, tmp_path, key, value, condition):
    """A config the spec does not compute fails the build, naming the condition: GraniteMoeSWA's model_type (attention
    sinks, sliding windows, per-layer RoPE), a top-k over more experts than there are."""
    import re
    from infc.compiler.contract.errors import SpecError
    d, _ = models["g30"]
    c = json.loads((d / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**c, key: value}))
    with pytest.raises(SpecError, match=re.escape(f"requirement '{condition}' does not hold")):
        compile_model(model_dir=str(tmp_path), check_checkpoint=False)


# -- through the generated kernels (interpreted) ---------------------------------------------------

@pytest.mark.parametrize("kind,fuse", [
    ("g30", True),
    pytest.param("g30", False, marks=EXHAUSTIVE),
    pytest.param("bias", True, marks=EXHAUSTIVE),
    pytest.param("bias", False, marks=EXHAUSTIVE),
], ids=["g30-fused", "g30-no-fuse", "bias-fused", "bias-no-fuse"])
def test_through_kernels(models, kind, fuse, tmp_path):
    check_kernels(*models[kind], tmp_path, fuse)


@pytest.mark.parametrize("kind", [pytest.param("g30", marks=EXHAUSTIVE), pytest.param("bias", marks=EXHAUSTIVE)])
def test_narrow_program_through_kernels(models, kind, tmp_path):
    """One sequence's decode steps through the narrow program (the norms merged into the GEMVs),
    then the wide one (tests/test_deepseek_v2_interp.py's check)."""
    from test_deepseek_v2_interp import check_through_kernels
    check_through_kernels(*models[kind], tmp_path)
