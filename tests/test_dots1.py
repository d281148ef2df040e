"""rednote dots.llm1 (specs/dots1.yaml: Dots1ForCausalLM) against transformers' own model: tiny
random float32 checkpoints made by transformers and saved with save_pretrained (its default
save_original_format=True writes the published per-expert layout mlp.experts.{e}.gate_proj.weight
etc., not transformers 5's fused mlp.experts.gate_up_proj), hidden 96, 4 query heads over 2 KV
heads of head_dim 32 (not hidden / heads), per-head q/k RMSNorm, the first layer dense and two MoE
layers of 8 routed experts with DeepSeek-V3's sigmoid router and a correction bias:
  grouped: 4 groups of which the best 2 are kept (the group limit bites), top-2, norm_topk_prob,
           routed_scaling_factor 2.5, two shared experts, q/k/v/o biases, layer 1 sliding
           (window 5, shorter than the prompt)
  inst:    dots.llm1.inst's form: ungrouped, top-3, renormalized, scaling 1.5, one shared expert,
           no biases, every layer full attention, the config.json rewritten into the published
           (transformers 4.x) form: rope_theta at the top, no layer_types, n_group / topk_group null
Every RMSNorm, every attention bias and a correction bias large enough to move the choices are
random (HF initializes them to 1, 0 and 0).

The reference executor must give HF's (eager, float32) logits at every position of a 24-token
prompt within 1e-4, as 24 prefixes in one step and one token per step, and the same 16 greedy
tokens as generate(); the generated kernels under the interpreter (TRITON_INTERPRET=1), fused and
--no-fuse, match the reference (tests/test_glm4_moe.py's checks); each distinctive feature, taken
out of the spec, moves the logits away from HF's.
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

BASE = dict(vocab_size=VOCAB, hidden_size=96, intermediate_size=128, moe_intermediate_size=32,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            n_routed_experts=8, first_k_dense_replace=1, rms_norm_eps=1e-5,
            max_position_embeddings=512, initializer_range=0.08, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
VARIANTS = {
    "grouped": dict(n_group=4, topk_group=2, num_experts_per_tok=2, norm_topk_prob=True,
                    routed_scaling_factor=2.5, n_shared_experts=2, attention_bias=True,
                    sliding_window=5,
                    layer_types=["full_attention", "sliding_attention", "full_attention"]),
    "inst": dict(n_group=1, topk_group=1, num_experts_per_tok=3, norm_topk_prob=True,
                 routed_scaling_factor=1.5, n_shared_experts=1, attention_bias=False,
                 sliding_window=None, max_window_layers=3),
}


def randomize(model, seed=7):
    """Every norm weight 1 + 0.3 N(0, 1), every attention bias 0.1 N(0, 1), every router's
    correction bias 0.5 N(0, 1): large against the sigmoid scores' spread, so it moves choices."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                gate.e_score_correction_bias.copy_(0.5 * torch.randn(gate.e_score_correction_bias.shape, generator=gen))


def published_form(d):
    """Rewrite d/config.json as transformers 4.x wrote dots.llm1's: rope_theta at the top level,
    no rope_parameters or layer_types, n_group / topk_group null."""
    c = json.loads((d / "config.json").read_text())
    rp = c.pop("rope_parameters")
    c.pop("layer_types")
    c.update(rope_theta=rp["rope_theta"], rope_scaling=None, n_group=None, topk_group=None)
    (d / "config.json").write_text(json.dumps(c, indent=2))


def make(kind: str, d, **over):
    from transformers import Dots1Config, Dots1ForCausalLM
    model = tiny_hf(Dots1ForCausalLM, Dots1Config, {**BASE, **VARIANTS[kind], **over},
                    d, 4330, randomize=randomize)
    if kind == "inst":
        published_form(d)
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_all(tmp_path_factory, "dots1", VARIANTS, make)


def test_published_names_and_plan(models):
    """The checkpoints have the published tensor names (per-expert gate/up/down, the router and
    its correction bias under mlp.gate, the shared experts as one MLP of n_shared * Fe) and the
    plans read them: layer 0 dense, per-head q/k norms [D], the bias f32, every router sigmoid
    with the bias; the grouped model's layer 1 windowed."""
    for kind, (d, _) in models.items():
        tensors = checkpoint_tensors(d)
        names = set(tensors)
        assert "model.layers.2.mlp.experts.7.up_proj.weight" in names
        assert "model.layers.1.mlp.gate.e_score_correction_bias" in names
        assert "model.layers.0.mlp.gate_proj.weight" in names
        assert not any("gate_up_proj" in n for n in names)
        width = 32 * VARIANTS[kind]["n_shared_experts"]
        assert tensors["model.layers.1.mlp.shared_experts.gate_proj.weight"].shape == (width, 96)
        assert tensors["model.layers.0.self_attn.q_norm.weight"].shape == (32,)
        assert ("model.layers.0.self_attn.o_proj.bias" in names) == (kind == "grouped")
        plan, _ = plan_and_weights(d)
        schedule = next(r for r in plan["programs"]["decode"] if "repeat" in r)["schedule"]
        slide = "sliding" if kind == "grouped" else "full"
        assert schedule == ["dense_full_attention", f"moe_{slide}_attention", "moe_full_attention"]
        assert plan["weights"]["router_bias"]["layers"] == [1, 2]
        assert plan["weights"]["router_bias"]["dtype"] == "f32"
        assert plan["config"]["n_group"] == (4 if kind == "grouped" else 1)
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


# -- each distinctive feature bites ----------------------------------------------------------------

def broken_logits(d, spec_file, old, new, tmp_path, prompt=PROMPT) -> np.ndarray:
    """The reference's logits [len(prompt), V] (every prefix of prompt) under the built-in spec
    spec_file with `old` replaced by `new` (the checkpoint check off: a broken spec may leave a
    tensor unread)."""
    from infc.compiler.contract.safetensors_io import Checkpoint
    from infc.compiler.spec import SPECS_DIR
    from infc.runtime.weights.load import load_weights
    text = (SPECS_DIR / spec_file).read_text()
    assert old in text, old
    path = tmp_path / spec_file
    path.write_text(text.replace(old, new))
    _, plan = compile_model(model_dir=str(d), spec_path=str(path), check_checkpoint=False)
    ex = ReferenceExecutor(plan, load_weights(plan, Checkpoint(d)))
    return ex.step([SeqChunk(k, prompt[:k], 0) for k in range(1, len(prompt) + 1)])


def assert_break_bites(models, kind, spec_file, old, new, tmp_path, floor=1e-3):
    """The spec with `old` replaced by `new` (a feature taken out) is far from HF's logits (more than
    floor, ten times the tolerance the model tests hold the spec to)."""
    d, hf = models[kind]
    got = broken_logits(d, spec_file, old, new, tmp_path)
    err = float(np.abs(got - hf_logits(hf, PROMPT)).max())
    assert err > floor, (old, new, err)


BREAKS = {   # feature -> (variant, old spec text, the text that takes the feature out)
    "correction_bias": ("grouped", 'scoring="sigmoid", bias=router_bias', 'scoring="sigmoid"'),
    "group_limit": ("grouped", "topk_groups=topk_group", "topk_groups=n_group"),
    "routed_scaling": ("inst", "scale=rsf", "scale=1.0"),
    "renormalize": ("inst", "K, norm_topk,", "K, not norm_topk,"),
    "shared_experts": ("inst", "add(moe_experts(h, topw, topi, we_gate, we_up, we_down), shared)",
                       "moe_experts(h, topw, topi, we_gate, we_up, we_down)"),
    "q_norm": ("inst", "q = rms_norm(view(linear(h, wq, bias=bq), [T, Hq, D]), q_norm, eps)",
               "q = view(linear(h, wq, bias=bq), [T, Hq, D])"),
    "o_bias": ("grouped", "wo, bias=bo", "wo"),
    "sliding_window": ("grouped", "symbols: {window: swa}", "symbols: {window: none}"),
}


@pytest.mark.parametrize("feature", list(BREAKS))
def test_feature_taken_out_moves_logits(models, feature, tmp_path):
    kind, old, new = BREAKS[feature]
    assert_break_bites(models, kind, "dots1.yaml", old, new, tmp_path)


def test_the_router_features_bite_in_hf(models):
    """What the model tests rest on: on this prompt, HF's choices move when the correction bias is
    zeroed or the group limit lifted (so a spec that lost either would choose differently)."""
    d, hf = models["grouped"]
    base = hf_routes(hf, PROMPT)
    for change in ("bias", "groups"):
        other = copy.deepcopy(hf)
        for layer in other.model.layers[1:]:
            if change == "bias":
                layer.mlp.gate.e_score_correction_bias.zero_()
            else:
                layer.mlp.gate.topk_group = layer.mlp.gate.num_group
        moved = sum(int((a != b).any(-1).sum()) for a, b in zip(base, hf_routes(other, PROMPT)))
        assert moved >= 3, (change, moved)


# -- configs ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", ["dots.llm1.inst", "dots.llm1.base"])
def test_published_variants_agree_with_hf(variant):
    """Each variant (published config.json values, no weights) builds, and what the plan derives
    agrees with what transformers derives from the same values: the dense / MoE layer kinds and
    HF's layer_types, the head dim, the shared experts' width, the router's settings."""
    from transformers import Dots1Config
    from infc.compiler.spec import SPECS_DIR, load_spec
    values = dict(load_spec(SPECS_DIR / "dots1.yaml").variants[variant])
    _, plan = compile_model(variant)
    hf = Dots1Config(**{k: v for k, v in values.items() if k not in ("architectures", "model_type")})
    schedule = next(r for r in plan["programs"]["decode"] if "repeat" in r)["schedule"]
    assert schedule == [("moe" if i >= hf.first_k_dense_replace else "dense") + "_" + hf.layer_types[i]
                        for i in range(hf.num_hidden_layers)]
    c = plan["config"]
    assert c["D"] == hf.hidden_size // hf.num_attention_heads == 128
    assert c["Fs"] == hf.moe_intermediate_size * hf.n_shared_experts
    assert (c["E"], c["K"], c["rsf"], c["norm_topk"]) == \
        (hf.n_routed_experts, hf.num_experts_per_tok, hf.routed_scaling_factor, hf.norm_topk_prob)
    assert (c["theta"], c["eps"], c["V"], c["L"]) == \
        (hf.rope_parameters["rope_theta"], hf.rms_norm_eps, hf.vocab_size, hf.num_hidden_layers)
    # null in config.json: HF keeps None (its router could not be built with it); one group here
    assert hf.n_group is None and (c["n_group"], c["topk_group"]) == (1, 1)


def test_config_defaults_are_hf(models, tmp_path):
    """A config.json without the optional keys binds to the values HF's Dots1Config gives them
    (no dense layer, ungrouped, unscaled, norm_topk_prob false, eps 1e-6, theta 10000, no biases,
    every layer full attention, head_dim hidden / heads)."""
    from transformers import Dots1Config
    d, _ = models["grouped"]
    c = json.loads((d / "config.json").read_text())
    keep = ("architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
            "moe_intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "n_routed_experts", "num_experts_per_tok", "n_shared_experts")
    cfg = {k: c[k] for k in keep}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    _, plan = compile_model(model_dir=str(tmp_path), check_checkpoint=False)
    hf = Dots1Config(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    got = plan["config"]
    assert got["D"] == 96 // 4
    assert (got["first_dense"], got["n_group"], got["topk_group"], got["rsf"], got["norm_topk"],
            got["eps"], got["theta"], got["attn_bias"], got["tie"], got["act"], got["max_len"]) == \
        (hf.first_k_dense_replace, hf.n_group, hf.topk_group, hf.routed_scaling_factor,
         hf.norm_topk_prob, hf.rms_norm_eps, hf.rope_parameters["rope_theta"], hf.attention_bias,
         hf.tie_word_embeddings, hf.hidden_act, hf.max_position_embeddings)
    schedule = next(r for r in plan["programs"]["decode"] if "repeat" in r)["schedule"]
    assert schedule == ["moe_" + t for t in hf.layer_types]


def test_window_layers_without_layer_types_are_hfs(models, tmp_path):
    """Without layer_types, HF's Dots1Config slides the layers from max_window_layers on whenever
    sliding_window is set (use_sliding_window is not read): the spec's kinds are HF's."""
    from transformers import Dots1Config
    d, _ = models["inst"]
    c = json.loads((d / "config.json").read_text())
    cfg = {**c, "sliding_window": 5, "max_window_layers": 2, "use_sliding_window": False}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    _, plan = compile_model(model_dir=str(tmp_path), check_checkpoint=False)
    hf = Dots1Config(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type",
                                                                   "transformers_version", "dtype")})
    schedule = next(r for r in plan["programs"]["decode"] if "repeat" in r)["schedule"]
    assert hf.layer_types == ["full_attention", "full_attention", "sliding_attention"]
    assert schedule == [("moe" if i else "dense") + "_" + t for i, t in enumerate(hf.layer_types)]


def test_config_outside_hfs_math_is_refused(models, tmp_path):
    """A scoring_func other than sigmoid (HF's router reads none), no shared expert (HF cannot
    build one of width 0), a group count not dividing the experts, an unknown layer type: each
    fails the build, naming the condition."""
    from infc.compiler.contract.errors import SpecError
    d, _ = models["grouped"]
    c = json.loads((d / "config.json").read_text())
    for i, (key, value) in enumerate((("scoring_func", "softmax"), ("n_shared_experts", 0),
                                      ("n_group", 3), ("layer_types", ["full_attention", "chunked", "full_attention"]))):
        out = tmp_path / str(i)
        out.mkdir()
        (out / "config.json").write_text(json.dumps({**c, key: value}))
        with pytest.raises(SpecError):
            compile_model(model_dir=str(out), check_checkpoint=False)


# -- through the generated kernels (interpreted) ---------------------------------------------------

@pytest.mark.parametrize("kind,fuse", [
    ("grouped", True),
    pytest.param("grouped", False, marks=EXHAUSTIVE),
    pytest.param("inst", True, marks=EXHAUSTIVE),
    pytest.param("inst", False, marks=EXHAUSTIVE),
], ids=["grouped-fused", "grouped-no-fuse", "inst-fused", "inst-no-fuse"])
def test_through_kernels(models, kind, fuse, tmp_path):
    check_kernels(*models[kind], tmp_path, fuse)


@pytest.mark.parametrize("kind", [pytest.param("grouped", marks=EXHAUSTIVE), pytest.param("inst", marks=EXHAUSTIVE)])
def test_narrow_program_through_kernels(models, kind, tmp_path):
    """One sequence's decode steps through the narrow program (the norms merged into the GEMVs),
    then the wide one (tests/test_deepseek_v2_interp.py's check)."""
    from test_deepseek_v2_interp import check_through_kernels
    check_through_kernels(*models[kind], tmp_path)
