"""Granite MoE with sliding-window attention (specs/granitemoe_swa.yaml: GraniteMoeSWAForCausalLM)
against transformers' own model: tiny random float32 checkpoints made by transformers 5.23 and
saved with save_pretrained (transformers 5's expert names: block_sparse_moe.experts.gate_up_proj
[E, 2F, H], experts.down_proj [E, H, F], router.weight; the shared MLP's input_linear /
output_linear; a sink per head in every layer), hidden 96, 3 query heads over 1 KV head of 32, 8
experts of width 32, Granite's four scalars away from 1, a window of 5 tokens (the prompt is 24):
  nope: layers sliding, full, sliding with layer_rope_theta [1000, 0, 0] (RoPE at a base other
        than rope_theta on the first, NoPE on the others), a 64-wide shared MLP
  bias: HF's default layer pattern (full, sliding), every layer RoPE at rope_theta 500 (no
        layer_rope_theta: HF fills it in), attention biases, an untied lm_head, no shared MLP
  bases: four layers at RoPE bases 1000, 50, NoPE, 1000 (a kind's symbols read the layer index:
        the sliding RoPE kind lowers to a body per base)
Every RMSNorm weight, bias and sink is random (HF initializes them to 1, 0 and 0).

The reference executor must give HF's (eager, float32) logits at every position of a 24-token
prompt within 1e-4, as 24 prefixes in one step and one token a step, and the same 16 greedy
tokens as generate(); the generated kernels under the interpreter, fused and --no-fuse, match the
reference; the sinks, the window, NoPE, the per-layer RoPE base and the gate | up order each bite.
"""
import json

import numpy as np
import pytest
import torch

from infc.compiler.build import compile_model
from infc.runtime.reference.executor import ReferenceExecutor, SeqChunk

from exhaustive import EXHAUSTIVE
from families import checkpoint_tensors, hf_greedy, hf_logits, plan_and_weights, reference_greedy
from test_deepseek_v2 import PROMPT, TOL, VOCAB, assert_logits, make_all
from test_glm4_moe import check_kernels
from test_granitemoe import randomize

BASE = dict(vocab_size=VOCAB, hidden_size=96, intermediate_size=32, num_attention_heads=3,
            num_key_value_heads=1, num_local_experts=8, num_experts_per_tok=2, rms_norm_eps=1e-6,
            max_position_embeddings=256, initializer_range=0.08, bos_token_id=1, eos_token_id=2,
            sliding_window=5, embedding_multiplier=12.0, residual_multiplier=0.22,
            attention_multiplier=0.05, logits_scaling=2.5)
VARIANTS = {
    "nope": dict(num_hidden_layers=3, shared_intermediate_size=64, tie_word_embeddings=True,
                 layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                 layer_rope_theta=[1000.0, 0, 0]),
    "bias": dict(num_hidden_layers=2, attention_bias=True, tie_word_embeddings=False,
                 rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
    # two RoPE bases and NoPE: a kind's symbols read the layer index (a body per base)
    "bases": dict(num_hidden_layers=4, layer_types=["sliding_attention", "sliding_attention",
                                                    "full_attention", "sliding_attention"],
                  layer_rope_theta=[1000.0, 50.0, 0, 1000.0]),
}
SCHEDULES = {"nope": ["sliding_attention_rope_shared", "full_attention_nope_shared", "sliding_attention_nope_shared"],
             "bias": ["full_attention_rope", "sliding_attention_rope"],
             "bases": ["sliding_attention_rope", "sliding_attention_rope@1", "full_attention_nope",
                       "sliding_attention_rope"]}


def make(kind: str, d, **over):
    from transformers import GraniteMoeSWAConfig, GraniteMoeSWAForCausalLM
    torch.manual_seed(4332)
    model = GraniteMoeSWAForCausalLM(GraniteMoeSWAConfig(**{**BASE, **VARIANTS[kind], **over})).float().eval()
    model.set_attn_implementation("eager")
    randomize(model)
    gen = torch.Generator().manual_seed(8)
    with torch.no_grad():             # sinks: logits the size of the scores (HF's init: 0)
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.randn(layer.self_attn.sinks.shape, generator=gen))
    model.save_pretrained(d)
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_all(tmp_path_factory, "granitemoe_swa", VARIANTS, make)


def test_published_names_and_plan(models):
    """The checkpoint has save_pretrained's names (transformers 5's experts.gate_up_proj /
    down_proj and router.weight, the shared MLP's input_linear, a sink per layer) and the plan
    reads them: each layer's kind its attention type, RoPE or NoPE and shared MLP, the RoPE base
    the layers' own; the windows on the sliding layers only."""
    for kind, (d, hf) in models.items():
        tensors = checkpoint_tensors(d)
        assert tensors["model.layers.1.block_sparse_moe.experts.gate_up_proj"].shape == (8, 64, 96)
        assert tensors["model.layers.1.block_sparse_moe.experts.down_proj"].shape == (8, 96, 32)
        assert tensors["model.layers.0.block_sparse_moe.router.weight"].shape == (8, 96)
        assert tensors["model.layers.1.self_attn.sinks"].shape == (3,)
        assert ("model.layers.0.shared_mlp.input_linear.weight" in tensors) == (kind == "nope")
        assert not any("input_linear" in n and "block_sparse_moe" in n for n in tensors)
        plan, _ = plan_and_weights(d)
        repeat = next(e for e in plan["programs"]["decode"] if "repeat" in e)
        assert repeat["schedule"] == SCHEDULES[kind]
        assert [s.startswith("full") for s in SCHEDULES[kind]] == \
            [t == "full_attention" for t in hf.config.layer_types]
        body = repeat["kinds"]
        for i, name in enumerate(repeat["schedule"]):   # each rotating layer at its own base
            thetas = {json.dumps(l["attrs"].get("theta")) for l in body[name] if l["op"] in ("rope", "qk_norm_rope_cache")}
            base = hf.config.layer_rope_theta[i]
            assert thetas == ({json.dumps(base)} if base else set()), (i, name, thetas)
        assert plan["weights"]["sinks"]["dtype"] == "f32"


@pytest.mark.parametrize("kind", list(VARIANTS))
def test_logits_and_greedy_match_hf(models, kind):
    d, hf = models[kind]
    want = hf_logits(hf, PROMPT)
    plan, weights = plan_and_weights(d)
    assert_logits(plan, weights, want, PROMPT)
    greedy = hf_greedy(hf, PROMPT, 16, VOCAB - 1)
    assert reference_greedy(plan, weights, PROMPT, 16) == greedy


# -- each SWA-specific piece bites: a spec without it is away from HF ---------------------------

def broken_logits(d, tmp_path, *changes) -> np.ndarray:
    """The reference's prefill logits of PROMPT for the checkpoint in d under a copy of the spec
    with each change (old, new, count) made."""
    from infc.compiler.contract.safetensors_io import Checkpoint
    from infc.compiler.spec import SPECS_DIR
    from infc.runtime.weights.load import load_weights
    text = (SPECS_DIR / "granitemoe_swa.yaml").read_text()
    for old, new, count in changes:
        assert text.count(old) == count, old
        text = text.replace(old, new)
    path = tmp_path / "granitemoe_swa.yaml"
    path.write_text(text)
    _, plan = compile_model(model_dir=str(d), spec_path=str(path))
    return ReferenceExecutor(plan, load_weights(plan, Checkpoint(d))).step([SeqChunk(0, PROMPT, 0)])


BREAKS = {
    # the sinks join every layer's softmax denominator (the broken copy leaves them unread)
    "sinks": [(", v, sinks,", ", v,", 4),
              ("\nweights:\n", '\nignore: ["model.layers.*.self_attn.sinks"]\nweights:\n', 1)],
    # the sliding layers attend over the last sliding_window tokens
    "window": [("symbols: {window: swa", "symbols: {window: none", 4)],
    # layer_rope_theta 0: no rotation (NoPE), rotated here with the layers' base
    "nope": [("attention(q, k, v, sinks,", "attention(rope(q, rope_theta_l, rope_scaling), "
              "rope(k, rope_theta_l, rope_scaling), v, sinks,", 2)],
    # the rotating layers' own base (layer_rope_theta), not rope_theta
    "layer_rope_theta": [("rope(q, rope_theta_l, rope_scaling), rope(k, rope_theta_l, rope_scaling)",
                          "rope(q, theta, rope_scaling), rope(k, theta, rope_scaling)", 2)],
    # gate_up_proj's first F rows are the gate, the last F the up projection
    "gate_up_order": [("experts: E, rows: [0, F]}", "experts: E, rows: [@]}", 1),
                      ("experts: E, rows: [F, 2*F]}", "experts: E, rows: [0, F]}", 1),
                      ("rows: [@]}", "rows: [F, 2*F]}", 1)],
}


@pytest.mark.parametrize("name", list(BREAKS))
def test_each_feature_bites(models, tmp_path, name):
    """With one feature taken away the logits are far (> 100 x TOL) from HF's at some position
    (the nope variant: every feature is in it)."""
    d, hf = models["nope"]
    got = broken_logits(d, tmp_path, *BREAKS[name])
    assert np.abs(got - hf_logits(hf, PROMPT)).max() > 100 * TOL, name


# -- config.json: HF's defaults, what the spec refuses --------------------------------------------

def test_config_defaults_are_hf(models, tmp_path):
    """A config.json without the optional keys binds to what HF's GraniteMoeSWAConfig makes of it:
    every 4th layer (i % 4 == 0) full and the rest sliding over 128 tokens, every layer RoPE at
    rope_theta (10000), no shared MLP, 8 experts, top-2, the scalars 1."""
    from transformers import GraniteMoeSWAConfig
    d, _ = models["bias"]
    c = json.loads((d / "config.json").read_text())
    keep = ("architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
            "num_attention_heads")
    cfg = {**{k: c[k] for k in keep}, "num_hidden_layers": 6}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    _, plan = compile_model(model_dir=str(tmp_path), check_checkpoint=False)
    hf = GraniteMoeSWAConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    schedule = next(r for r in plan["programs"]["decode"] if "repeat" in r)["schedule"]
    assert schedule == [t + "_rope" for t in hf.layer_types]
    got = plan["config"]
    assert (got["swa"], got["rope_theta_l"], got["shared_size"], got["E"], got["K"], got["emb_mult"],
            got["res_mult"], got["attn_mult"], got["logits_scaling"], got["eps"], got["Hkv"]) == \
        (hf.sliding_window, hf.layer_rope_theta[0], hf.shared_intermediate_size, hf.num_local_experts,
         hf.num_experts_per_tok, hf.embedding_multiplier, hf.residual_multiplier, hf.attention_multiplier,
         hf.logits_scaling, hf.rms_norm_eps, hf.num_key_value_heads)
    assert set(hf.layer_rope_theta) == {10000.0}


@pytest.mark.parametrize("key,value,match", [
    ("layer_rope_theta", [1000.0, 0], "requirement '(len(layer_theta) == L) if layer_theta else true'"),
    ("layer_types", ["full_attention", "chunked_attention", "full_attention"], "layer 1 has kind 'chunked_attention"),
], ids=["theta-list-length", "layer-type"])
def test_config_outside_the_spec_is_refused(models, tmp_path, key, value, match):
    """A config the spec does not compute fails the build, naming the layer or the condition: a
    per-layer list of the wrong length, an attention type HF's
    GraniteMoeSWA does not have (another expert activation runs: tests/test_granitemoe.py)."""
    import re
    from infc.compiler.contract.errors import SpecError
    d, _ = models["nope"]
    c = json.loads((d / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**c, key: value}))
    with pytest.raises(SpecError, match=re.escape(match)):
        compile_model(model_dir=str(tmp_path), check_checkpoint=False)


# -- through the generated kernels (interpreted) ---------------------------------------------------

@pytest.mark.parametrize("kind,fuse", [
    ("nope", True),
    pytest.param("nope", False, marks=EXHAUSTIVE),
    pytest.param("bias", True, marks=EXHAUSTIVE),
    pytest.param("bias", False, marks=EXHAUSTIVE),
], ids=["nope-fused", "nope-no-fuse", "bias-fused", "bias-no-fuse"])
def test_through_kernels(models, kind, fuse, tmp_path):
    check_kernels(*models[kind], tmp_path, fuse)


@pytest.mark.parametrize("kind", [pytest.param("nope", marks=EXHAUSTIVE), pytest.param("bias", marks=EXHAUSTIVE)])
def test_narrow_program_through_kernels(models, kind, tmp_path):
    """One sequence's decode steps through the narrow program (the norms merged into the GEMVs),
    then the wide one (tests/test_deepseek_v2_interp.py's check)."""
    from test_deepseek_v2_interp import check_through_kernels
    check_through_kernels(*models[kind], tmp_path)
