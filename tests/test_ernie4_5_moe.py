"""ERNIE-4.5 MoE (specs/ernie4_5_moe.yaml: Ernie4_5_MoeForCausalLM) against transformers' own model:
tiny random float32 checkpoints made by transformers and saved with save_pretrained (its default
writes the published layout: mlp.experts.{e}.gate_proj.weight etc. and
mlp.moe_statics.e_score_correction_bias [1, E], not transformers 5's fused gate_up_proj and
mlp.gate.moe_statics.*), hidden 96, 4 query heads over 2 KV heads of head_dim 32 (not hidden /
heads), interleaved RoPE over the whole head, 8 routed experts of 32:
  a3b:  ERNIE-4.5-21B-A3B's form: tied embeddings, two shared experts, MoE from layer 1 on
        (dense, moe, moe), top-3; use_bias on (published off) so that every bias HF builds
        with it (q/k/v/o, dense MLP, shared experts, lm_head) is exercised
  a47b: ERNIE-4.5-300B-A47B's form: no shared expert, untied lm_head, no biases, top-2, and a
        layer schedule where start, interval and end each bite: 6 layers, moe_layer_start_index 2,
        interval 2, end 4: only layer 3 is MoE (1 is before the start, 5 after the end, the even
        ones off the interval)
Every RMSNorm and bias is random (HF initializes them to 1 and 0), and the correction bias is
large enough against the softmax probabilities' spread to move the choices.

The reference executor must give HF's (eager, float32) logits at every position of a 24-token
prompt within 1e-4, as 24 prefixes in one step and one token per step, and the same 16 greedy
tokens as generate(); the generated kernels under the interpreter (TRITON_INTERPRET=1), fused and
--no-fuse, match the reference (tests/test_glm4_moe.py's checks); the spec broken in each of the
family's own features (interleaved RoPE, the correction bias, the renormalization, the shared
experts) moves the logits away from HF's.
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

FAMILY = "ernie4_5_moe"
BASE = dict(vocab_size=VOCAB, hidden_size=96, intermediate_size=64, moe_intermediate_size=32,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, moe_num_experts=8,
            rms_norm_eps=1e-5, max_position_embeddings=512, initializer_range=0.08,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
VARIANTS = {
    "a3b": dict(num_hidden_layers=3, moe_k=3, moe_num_shared_experts=2, moe_layer_start_index=1,
                moe_layer_interval=1, use_bias=True, tie_word_embeddings=True),
    "a47b": dict(num_hidden_layers=6, moe_k=2, moe_num_shared_experts=0, moe_layer_start_index=2,
                 moe_layer_interval=2, moe_layer_end_index=4, use_bias=False, tie_word_embeddings=False),
}
SCHEDULES = {"a3b": ["dense", "moe_shared", "moe_shared"],
             "a47b": ["dense", "dense", "dense", "moe", "dense", "dense"]}


def randomize(model, seed=7):
    """Every norm weight 1 + 0.3 N(0, 1), every bias 0.1 N(0, 1), every correction bias 0.1 N(0, 1)
    (against softmax probabilities of about 1/8 that differ by a few hundredths: it moves choices)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("e_score_correction_bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))


def make(kind: str, d, **over):
    from transformers import Ernie4_5_MoeConfig, Ernie4_5_MoeForCausalLM
    return tiny_hf(Ernie4_5_MoeForCausalLM, Ernie4_5_MoeConfig, {**BASE, **VARIANTS[kind], **over},
                   d, 4330, randomize=randomize)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_all(tmp_path_factory, FAMILY, VARIANTS, make)


def test_published_names_and_layer_kinds(models):
    """The checkpoint has the published tensor names (per expert, the router, the correction bias
    as mlp.moe_statics.* [1, E], the shared experts; the biases with use_bias) and the plan reads
    them in the layer kinds HF builds (a SparseMoeBlock exactly where the plan has a MoE kind)."""
    from transformers.models.ernie4_5_moe.modeling_ernie4_5_moe import Ernie4_5_MoeSparseMoeBlock
    for kind, (d, hf) in models.items():
        tensors = checkpoint_tensors(d)
        moe = [i for i, layer in enumerate(hf.model.layers) if isinstance(layer.mlp, Ernie4_5_MoeSparseMoeBlock)]
        i = moe[0]
        assert tensors[f"model.layers.{i}.mlp.moe_statics.e_score_correction_bias"].shape == (1, 8)
        assert f"model.layers.{i}.mlp.experts.7.down_proj.weight" in tensors
        assert f"model.layers.{i}.mlp.gate.weight" in tensors
        assert not any("gate_up_proj" in n for n in tensors)
        assert (f"model.layers.{i}.mlp.shared_experts.up_proj.weight" in tensors) == (kind == "a3b")
        assert ("lm_head.bias" in tensors) == ("model.layers.0.mlp.down_proj.bias" in tensors) == (kind == "a3b")
        assert ("lm_head.weight" in tensors) == (kind == "a47b")
        plan, _ = plan_and_weights(d)
        schedule = next(e for e in plan["programs"]["decode"] if "repeat" in e)["schedule"]
        assert schedule == SCHEDULES[kind]
        assert [i for i, k in enumerate(schedule) if k != "dense"] == moe
        assert plan["weights"]["router_bias"]["layers"] == moe
        assert plan["weights"]["router_bias"]["dtype"] == "f32"
        assert plan["config"]["D"] == 32
        routes = [n for n in json.dumps(plan["programs"]["prefill"]).split('"op": ') if n.startswith('"moe_route')]
        assert routes and all('"has_bias": true' in n and '"scoring"' not in n for n in routes)


@pytest.mark.parametrize("kind", list(VARIANTS))
def test_logits_and_greedy_match_hf(models, kind):
    d, hf = models[kind]
    want = hf_logits(hf, PROMPT)
    plan, weights = plan_and_weights(d)
    assert_logits(plan, weights, want, PROMPT)
    greedy = hf_greedy(hf, PROMPT, 16, VOCAB - 1)
    assert reference_greedy(plan, weights, PROMPT, 16) == greedy


def test_the_correction_bias_moves_hfs_choices(models):
    """What the bias break below rests on: on this prompt, HF's choices move when the correction
    bias is zeroed."""
    d, hf = models["a3b"]
    base = hf_routes(hf, PROMPT)
    other = copy.deepcopy(hf)
    for layer in other.model.layers[1:]:
        layer.mlp.gate.moe_statics.e_score_correction_bias.zero_()
    moved = sum(int((a != b).any(-1).sum()) for a, b in zip(base, hf_routes(other, PROMPT)))
    assert moved >= 3, moved


def broken_logits(d, tmp_path, old: str, new: str) -> np.ndarray:
    """The reference's logits at every position of PROMPT under the family's spec with `old`
    (which it must contain) replaced by `new`."""
    from infc.compiler.contract.safetensors_io import Checkpoint
    from infc.compiler.spec import SPECS_DIR
    from infc.runtime.weights.load import load_weights
    text = (SPECS_DIR / f"{FAMILY}.yaml").read_text()
    assert old in text, old
    path = tmp_path / f"{FAMILY}.yaml"
    path.write_text(text.replace(old, new))
    _, plan = compile_model(model_dir=str(d), spec_path=str(path))
    weights = load_weights(plan, Checkpoint(d))
    return ReferenceExecutor(plan, weights).step([SeqChunk(k, PROMPT[:k], 0) for k in range(1, len(PROMPT) + 1)])


BREAKS = {
    # rotate-half pairs (x[j], x[j + D/2]) instead of HF's interleaved (x[2j], x[2j + 1])
    "rope_interleaved": ("interleaved=true", "interleaved=false"),
    # the correction bias read but zeroed: p alone chooses
    "correction_bias": ("stored_shape: [1, E], dtype: f32}", "stored_shape: [1, E], dtype: f32, scale: 0.0}"),
    # the chosen probabilities not renormalized
    "renormalize": ("K, true, bias=router_bias, norm_min=norm_min", "K, false, bias=router_bias"),
    # the shared experts' output dropped
    "shared_experts": ("we_gate, we_up, we_down), shared)", "we_gate, we_up, we_down), mul(shared, 0.0))"),
}


@pytest.mark.parametrize("feature", list(BREAKS))
def test_breaking_a_feature_moves_the_logits_away_from_hf(models, tmp_path, feature):
    """The spec with one of the family's features broken gives logits far (100x the tolerance)
    from HF's: the model tests above would catch its loss."""
    d, hf = models["a3b"]
    got = broken_logits(d, tmp_path, *BREAKS[feature])
    assert np.abs(got - hf_logits(hf, PROMPT)).max() > 1e-2, feature


def test_mtp_tensors_are_ignored_as_hf_does(models, tmp_path):
    """The published checkpoints carry an MTP block HF's port does not build (it ignores every
    tensor whose name contains "mtp" on load): a checkpoint with such tensors builds, reads none
    of them, and gives HF's logits (HF loading the same directory)."""
    import shutil
    from safetensors.numpy import save_file
    from transformers import Ernie4_5_MoeForCausalLM
    d, _ = models["a47b"]
    out = tmp_path / "with-mtp"
    shutil.copytree(d, out)
    t = checkpoint_tensors(d)
    rng = np.random.default_rng(0)
    t["mtp_block.0.mlp.up_proj.weight"] = rng.standard_normal((64, 96)).astype(np.float32)
    t["mtp_emb_norm.0.weight"] = np.ones(96, np.float32)
    t["mtp_linear_proj.0.weight"] = rng.standard_normal((96, 192)).astype(np.float32)
    save_file(t, str(out / "model.safetensors"), metadata={"format": "pt"})
    hf = Ernie4_5_MoeForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    hf.set_attn_implementation("eager")
    _, plan = compile_model(model_dir=str(out))
    assert not any("mtp" in json.dumps(w["source"]) for w in plan["weights"].values())
    plan, weights = plan_and_weights(out)
    assert_logits(plan, weights, hf_logits(hf, PROMPT), PROMPT)


def hf_config(values: dict):
    from transformers import Ernie4_5_MoeConfig
    return Ernie4_5_MoeConfig(**{k: v for k, v in values.items() if k not in ("architectures", "model_type")})


def hf_schedule(cfg) -> list:
    """The MoE layers of HF's own decoder layers built from cfg (on the meta device: no memory)."""
    from transformers.models.ernie4_5_moe.modeling_ernie4_5_moe import (
        Ernie4_5_MoeDecoderLayer, Ernie4_5_MoeSparseMoeBlock)
    with torch.device("meta"):
        return [isinstance(Ernie4_5_MoeDecoderLayer(cfg, i).mlp, Ernie4_5_MoeSparseMoeBlock)
                for i in range(cfg.num_hidden_layers)]


@pytest.mark.parametrize("variant", ["ernie-4.5-21b-a3b", "ernie-4.5-300b-a47b"])
def test_published_variants_agree_with_hf(variant):
    """Each variant (published config.json values, no weights) builds, and what the plan derives
    agrees with what transformers derives from the same values: the MoE layers HF builds, the
    shared experts' width, the experts, top-k, heads, theta, eps, the tie."""
    from infc.compiler.spec import SPECS_DIR, load_spec
    values = dict(load_spec(SPECS_DIR / f"{FAMILY}.yaml").variants[variant])
    _, plan = compile_model(variant)
    hf = hf_config(values)
    schedule = next(r for r in plan["programs"]["decode"] if "repeat" in r)["schedule"]
    assert [k != "dense" for k in schedule] == hf_schedule(hf)
    shared = hf.moe_num_shared_experts > 0
    assert all(k == ("moe_shared" if shared else "moe") for k in schedule if k != "dense")
    c = plan["config"]
    assert c["Fs"] == hf.moe_intermediate_size * (hf.moe_num_shared_experts or 1)
    assert (c["E"], c["K"], c["Fe"], c["F"], c["L"], c["V"], c["Hq"], c["Hkv"]) == \
        (hf.num_experts, hf.num_experts_per_tok, hf.moe_intermediate_size, hf.intermediate_size,
         hf.num_hidden_layers, hf.vocab_size, hf.num_attention_heads, hf.num_key_value_heads)
    assert (c["theta"], c["eps"], c["tie"], c["norm_min"]) == \
        (hf.rope_parameters["rope_theta"], hf.rms_norm_eps, hf.tie_word_embeddings, hf.moe_norm_min)
    assert c["D"] == hf.hidden_size // hf.num_attention_heads == 128


def test_config_defaults_are_hf(models, tmp_path):
    """A config.json without the optional keys binds to the values HF's Ernie4_5_MoeConfig gives
    them (the experts, top-k, shared experts, MoE schedule, KV heads, eps, theta, tie, no bias)."""
    d, _ = models["a3b"]
    c = json.loads((d / "config.json").read_text())
    keep = ("architectures", "model_type", "vocab_size", "hidden_size", "num_hidden_layers",
            "num_attention_heads")
    cfg = {k: c[k] for k in keep}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    _, plan = compile_model(model_dir=str(tmp_path), check_checkpoint=False)
    hf = hf_config(cfg)
    got = plan["config"]
    assert (got["Hkv"], got["F"], got["Fe"], got["E"], got["K"], got["n_shared"], got["start"], got["end"],
            got["interval"], got["norm_min"], got["eps"], got["theta"], got["tie"], got["use_bias"], got["act"],
            got["max_len"]) == \
        (hf.num_key_value_heads, hf.intermediate_size, hf.moe_intermediate_size, hf.num_experts,
         hf.num_experts_per_tok, hf.moe_num_shared_experts, hf.moe_layer_start_index, hf.moe_layer_end_index,
         hf.moe_layer_interval, hf.moe_norm_min, hf.rms_norm_eps, hf.rope_parameters["rope_theta"],
         hf.tie_word_embeddings, hf.use_bias, hf.hidden_act, hf.max_position_embeddings)
    schedule = next(r for r in plan["programs"]["decode"] if "repeat" in r)["schedule"]
    assert [k != "dense" for k in schedule] == hf_schedule(hf)


def test_the_normalization_floor_bites_and_matches_hf(tmp_path):
    """HF divides the chosen probabilities by max(their sum, moe_norm_min) (moe_route's norm_min):
    with a floor of 0.9, above most rows' top-3 sums, the weights shrink as HF's do; the logits
    match HF's at every position, and differ from a plain renormalization's."""
    d = tmp_path / "floor"
    hf = make("a3b", d, moe_norm_min=0.9)
    plan, weights = plan_and_weights(d)
    text = json.dumps(plan)
    assert '"norm_min": 0.9' in text
    assert_logits(plan, weights, hf_logits(hf, PROMPT), PROMPT)
    broken = json.loads(text.replace('"norm_min": 0.9', '"norm_min": 0.0'))
    a = ReferenceExecutor(plan, weights).step([SeqChunk(0, PROMPT, 0)])
    b = ReferenceExecutor(broken, weights).step([SeqChunk(0, PROMPT, 0)])
    assert np.abs(a - b).max() > 1e-3


@pytest.mark.parametrize("key,value", [("moe_use_aux_free", False),
                                       ("moe_gate_act", "sigmoid"), ("hidden_act", "gelu")])
def test_config_outside_the_spec_is_refused(models, tmp_path, key, value):
    """Values whose math the spec does not compute fail the build naming the condition: keys
    HF's port does not read whose published values its math is (the bias-corrected choice,
    softmax scoring)."""
    from infc.compiler.contract.errors import SpecError
    d, _ = models["a3b"]
    c = json.loads((d / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**c, key: value}))
    with pytest.raises(SpecError, match="requirement "):
        compile_model(model_dir=str(tmp_path), check_checkpoint=False)


# -- through the generated kernels (interpreted) ---------------------------------------------------

@pytest.mark.parametrize("kind,fuse", [
    ("a3b", True),
    pytest.param("a3b", False, marks=EXHAUSTIVE),
    pytest.param("a47b", True, marks=EXHAUSTIVE),
    pytest.param("a47b", False, marks=EXHAUSTIVE),
], ids=["a3b-fused", "a3b-no-fuse", "a47b-fused", "a47b-no-fuse"])
def test_through_kernels(models, kind, fuse, tmp_path):
    check_kernels(*models[kind], tmp_path, fuse)


@pytest.mark.parametrize("kind", ["a3b", pytest.param("a47b", marks=EXHAUSTIVE)])
def test_narrow_program_through_kernels(models, kind, tmp_path):
    """One sequence's decode steps through the narrow program (the dense layers' norms merged into
    the GEMVs), then the wide one (tests/test_deepseek_v2_interp.py's check)."""
    from test_deepseek_v2_interp import check_through_kernels
    assert "narrow" in plan_and_weights(models[kind][0])[0]["programs"]
    check_through_kernels(*models[kind], tmp_path)
