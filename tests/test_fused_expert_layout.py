"""A weight's `or:` layouts (docs/spec-reference.md): the built-in MoE specs read a checkpoint
saved by transformers 5 with save_original_format=False (its fused, in-memory layout:
mlp.experts.gate_up_proj [E, 2F, H], mlp.experts.down_proj [E, H, F]; Mixtral's and MiniMax-M2's
router under mlp.) as well as the published per-expert one, with no flag: the build takes the
first layout whose every tensor the checkpoint holds.

Each family's tiny random float32 model (made by its own test file's maker) is saved both ways;
the fused checkpoint must hold no per-expert tensor, its plan must read the fused tensors, and its
reference logits must equal HF's at every position within 1e-4 and the per-expert build's
exactly (the same float32 numbers, sliced instead of stacked). A checkpoint holding neither layout
whole fails naming the tensor and the other layout; malformed `or:` entries fail naming the key.
"""
import json
import shutil

import numpy as np
import pytest

from infc.compiler.build import compile_model
from infc.compiler.contract.errors import SpecError
from infc.compiler.spec import load_spec
from infc.runtime.reference.executor import ReferenceExecutor, SeqChunk

from families import checkpoint_tensors, hf_logits, plan_and_weights

PROMPT = [int(t) for t in np.random.default_rng(5).integers(0, 320, 12)]


def _families_make(family):
    def make(d):
        from families import make as make_family
        return make_family(family, d)
    return make


def _qwen3_moe(d):
    import torch
    from conftest import _tiny
    torch.manual_seed(99)
    model = _tiny("qwen3_moe").float().eval()
    model.set_attn_implementation("eager")
    model.save_pretrained(d)
    return model


def _deepseek_v3(d):
    from test_deepseek_v2 import make
    return make("qlora", d)


def _glm4_moe(d):
    from test_glm4_moe import make
    return make("glm45", d)


def _minimax_m2(d):
    from test_minimax_m2 import make
    return make("m2", d)


def _qwen3_5_moe(d):
    import torch
    from test_qwen3_5_moe import _causal, _randomize
    torch.manual_seed(1234)
    model = _causal().float().eval()
    model.set_attn_implementation("eager")
    _randomize(model)
    model.save_pretrained(d)
    return model


MAKERS = {"mixtral": _families_make("mixtral"), "qwen2_moe": _families_make("qwen2_moe"),
          "olmoe": _families_make("olmoe"), "qwen3_moe": _qwen3_moe, "deepseek_v3": _deepseek_v3,
          "glm4_moe": _glm4_moe, "minimax_m2": _minimax_m2, "qwen3_5_moe": _qwen3_5_moe}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """family -> (per-expert dir, fused dir, HF model), made on first use."""
    cache = {}

    def get(family):
        if family not in cache:
            orig = tmp_path_factory.mktemp(f"{family}-orig")
            model = MAKERS[family](orig)
            fused = tmp_path_factory.mktemp(f"{family}-fused")
            model.save_pretrained(fused, save_original_format=False)
            cache[family] = (orig, fused, model)
        return cache[family]
    return get


def _logits(plan, weights, prompt):
    n = len(prompt)
    return np.stack(ReferenceExecutor(plan, weights).step(
        [SeqChunk(k, prompt[:k], 0) for k in range(1, n + 1)]))


@pytest.mark.parametrize("family", list(MAKERS))
def test_fused_checkpoint_builds_and_matches(saved, family):
    orig, fused, model = saved(family)
    names = set(checkpoint_tensors(fused))
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in names), sorted(names)[:20]
    assert not any(".experts.0." in n for n in names)
    plan, weights = plan_and_weights(fused)
    sources = json.dumps({k: w["source"] for k, w in plan["weights"].items()})
    assert "experts.gate_up_proj" in sources and "experts.{e}" not in sources
    got = _logits(plan, weights, PROMPT)
    want = hf_logits(model, PROMPT)
    assert np.abs(got - want).max() <= 1e-4 * max(1.0, np.abs(want).max())
    plan_o, weights_o = plan_and_weights(orig)
    assert "experts.{e}" in json.dumps({k: w["source"] for k, w in plan_o["weights"].items()})
    np.testing.assert_array_equal(got, _logits(plan_o, weights_o, PROMPT))


def test_neither_layout_whole_names_both(saved, tmp_path):
    """A fused checkpoint missing one layer's down_proj: the per-expert layout is not there
    either, so the build fails on the declared layout's tensor and names the other one."""
    from safetensors.numpy import save_file
    _, fused, _ = saved("mixtral")
    d = tmp_path / "broken"
    shutil.copytree(fused, d)
    tensors = checkpoint_tensors(d)
    del tensors["model.layers.1.mlp.experts.down_proj"]
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(SpecError) as e:
        compile_model(model_dir=str(d))
    msg = str(e.value)
    assert "block_sparse_moe.experts.0.w2.weight' (layer 0) is missing" in msg
    assert "model.layers.{i}.mlp.experts.down_proj" in msg and "other layout" in msg


def _spec_with(tmp_path, text):
    src = open("specs/mixtral.yaml").read()
    old = 'or: {name: "model.layers.{i}.mlp.experts.down_proj"}}'
    assert old in src
    p = tmp_path / "mixtral.yaml"
    p.write_text(src.replace(old, text))
    return p


@pytest.mark.parametrize("text, needle", [
    ('or: 3}', "'or' must be another layout"),
    ('or: []}', "'or' must be another layout"),
    ('or: {rows: [0, F]}}', "has no 'name'"),
    ('or: {name: "x.{i}", shape: [H, F]}}', "unknown field(s) ['shape']"),
    ('or: {name: "x.{i}", rows: [0]}}', "'rows' must be [start, stop]"),
])
def test_malformed_or_is_refused_by_key(tmp_path, text, needle):
    p = _spec_with(tmp_path, text)
    with pytest.raises(SpecError) as e:
        load_spec(p)
    assert needle in str(e.value) and "we_down" in str(e.value)
    assert e.value.line is not None


@pytest.mark.parametrize("par", [dict(expert_parallel_only=2), dict(tensor_parallel_size=2)],
                         ids=["ep2", "tp2"])
def test_fused_checkpoint_over_ranks(saved, par):
    """Each rank slices its experts (EP) or each expert's F rows (TP) out of the fused tensors:
    the ranks' logits equal the single-rank plan's."""
    from test_parallel import ranked, single
    _, fused, _ = saved("qwen3_moe")
    one, (many, _) = single(fused), ranked(fused, **par)
    chunks = [SeqChunk(0, PROMPT, 0)]
    np.testing.assert_allclose(np.stack(many.step(chunks)), np.stack(one.step(chunks)), atol=1e-4, rtol=0)
