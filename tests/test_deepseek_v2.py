"""DeepSeek-V2 (specs/deepseek_v2.yaml, issue 13) against transformers' DeepseekV2ForCausalLM.

Tiny random float32 checkpoints made by transformers itself and saved with save_pretrained, YaRN
rope (factor 40, mscale = mscale_all_dim = 0.707, so the softmax scale carries mscale ** 2 and the
ramp cuts through the rotary dims) and every RMSNorm random and non-zero:
  plain:  q_proj (q_lora_rank null), greedy top-k, routed_scaling_factor 1 (V2-Lite's form)
  qlora:  q_a_proj -> q_a_layernorm -> q_b_proj, group_limited_greedy (4 groups, best 2 kept),
          routed_scaling_factor 2.5
Each has first_k_dense_replace 1 (a dense layer, then MoE layers with 2 shared experts).

The reference executor (float32, the absorbed MLA: latent cache + head_linear) must give HF's
(eager, float32) logits at every position of a 24-token prompt within 1e-4 (as 24 prefixes in one
step, and one token per step) and the same 16 greedy tokens as generate(). The spec's `heads`
weight transform (W_uk / W_uv cut per head out of kv_b_proj) is checked against the checkpoint
tensor, and `infc build --model deepseek-v2-lite --no-compile` builds the published shapes.
"""
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from infc.compiler.build import compile_model
from infc.compiler.contract import caches
from infc.runtime.reference.executor import ReferenceExecutor, SeqChunk
from infc.compiler.contract.safetensors_io import Checkpoint
from infc.runtime.weights.load import load_weights

from families import hf_greedy, reference_greedy, tiny_hf

VOCAB = 320
TOL = 1e-4
PROMPT = [int(t) for t in np.random.default_rng(13).integers(0, VOCAB, 24)]
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 0.707,
        "mscale_all_dim": 0.707, "original_max_position_embeddings": 64, "beta_fast": 32,
        "beta_slow": 1}
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=24,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, first_k_dense_replace=1,
            n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=3, rms_norm_eps=1e-6,
            max_position_embeddings=2560, initializer_range=0.08, rope_parameters=YARN,
            tie_word_embeddings=False)
VARIANTS = {
    "plain": dict(q_lora_rank=None, topk_method="greedy", routed_scaling_factor=1.0),
    "qlora": dict(q_lora_rank=24, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                  routed_scaling_factor=2.5),
}


def _randomize(model):
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))


def make(kind: str, d, **over):
    """The tiny random model of this VARIANTS kind (BASE's fields replaced by over: the server
    suite's takes its real tokenizer's vocab_size), saved into d; returns the HF float32 model."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM
    return tiny_hf(DeepseekV2ForCausalLM, DeepseekV2Config, {**BASE, **VARIANTS[kind], **over},
                   d, 4321, randomize=_randomize)


def make_all(tmp_path_factory, family: str, variants, make_one) -> dict:
    """kind -> (directory, HF model) of each variant, made by make_one(kind, directory)."""
    out = {}
    for kind in variants:
        d = tmp_path_factory.mktemp(f"{family}-{kind}")
        out[kind] = (d, make_one(kind, d))
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_all(tmp_path_factory, "deepseek_v2", VARIANTS, make)


def assert_logits(plan, weights, want, prompt):
    """The reference's logits equal `want` (HF's, [len(prompt), V]) within TOL at every position:
    as len(prompt) prefixes in one step, then one token a step."""
    n = len(prompt)
    got = ReferenceExecutor(plan, weights).step([SeqChunk(k, prompt[:k], 0) for k in range(1, n + 1)])
    err = np.abs(got - want).max(axis=1)
    assert err.max() <= TOL, f"prefill: worst position {int(err.argmax())}, |diff| {err.max():.2e}"
    ex = ReferenceExecutor(plan, weights)
    err = [float(np.abs(ex.step([SeqChunk(0, [t], p)])[0] - want[p]).max()) for p, t in enumerate(prompt)]
    assert max(err) <= TOL, f"decode: worst position {int(np.argmax(err))}, |diff| {max(err):.2e}"


_PLANS = {}


def _plan(d):
    if str(d) not in _PLANS:
        _, plan = compile_model(model_dir=str(d))
        _PLANS[str(d)] = (plan, load_weights(plan, Checkpoint(d)))
    return _PLANS[str(d)]


def _hf_logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float().numpy()


def test_layer_kinds_and_latent_cache(models):
    for kind, (d, hf) in models.items():
        plan, _ = _plan(d)
        repeat = next(e for e in plan["programs"]["decode"] if "repeat" in e)
        suffix = "_qlora" if kind == "qlora" else ""
        assert repeat["schedule"] == ["dense" + suffix, "moe" + suffix, "moe" + suffix], kind
        assert caches.unit_elems(caches.of_plan(plan)["latent"]) == 32 + 8     # the latent + rope key
        assert "k" not in plan["caches"] and "v" not in plan["caches"]


def test_heads_transform_cuts_w_uk_w_uv_per_head(models):
    """w_uk[h] = kv_b_proj[h*(Dn+Dv) : h*(Dn+Dv)+Dn].T, w_uv[h] = the next Dv rows."""
    d, hf = models["plain"]
    plan, weights = _plan(d)
    assert plan["weights"]["w_uk"]["layers"] == [0, 1, 2]
    for i in range(3):
        wb = hf.model.layers[i].self_attn.kv_b_proj.weight.detach().numpy().reshape(4, 16 + 12, 32)
        assert np.array_equal(weights["w_uk"][i], wb[:, :16].transpose(0, 2, 1))
        assert np.array_equal(weights["w_uv"][i], wb[:, 16:])
    src = plan["weights"]["w_uk"]["source"]
    assert src["per_head"] and src["transpose"]["to"] == [4, 16, 32] and src["transpose"]["reshape"]["groups"] == 4
    assert plan["weights"]["w_uk"]["shape"] == [4, 32, 16]
    assert plan["weights"]["w_uv"]["shape"] == [4, 12, 32]


def test_heads_transform_recipe():
    from infc.runtime.weights.recipes import build
    wb = np.arange(2 * 5 * 3, dtype=np.float32).reshape(2 * 5, 3)      # 2 heads of 2 + 3 rows, K 3
    read = {"w": wb}.__getitem__
    sl = {"slice": {"tensor": "w"}, "axis": 0, "start": 0, "stop": 2, "groups": 2}
    uk, _ = build({"transpose": {"reshape": sl, "from": [4, 3], "to": [2, 2, 3]}, "per_head": True}, None, read)
    assert np.array_equal(uk, wb.reshape(2, 5, 3)[:, :2].transpose(0, 2, 1))
    sl = dict(sl, start=2, stop=5)
    uv, _ = build({"reshape": sl, "from": [6, 3], "to": [2, 3, 3]}, None, read)
    assert np.array_equal(uv, wb.reshape(2, 5, 3)[:, 2:])


def test_heads_transform_needs_a_3d_shape(tmp_path, models):
    from infc.compiler.contract.errors import SpecError
    from pathlib import Path
    spec = (Path(__file__).resolve().parent.parent / "specs" / "deepseek_v2.yaml").read_text()
    bad = spec.replace("shape: [Hq, Dv, Dc],", "shape: [Hq*Dv, Dc],")
    assert bad != spec
    (tmp_path / "deepseek_v2.yaml").write_text(bad)
    with pytest.raises(SpecError, match="heads"):
        compile_model(model_dir=str(models["plain"][0]), spec_path=str(tmp_path / "deepseek_v2.yaml"))


@pytest.mark.parametrize("kind", list(VARIANTS))
def test_logits_at_every_position(models, kind):
    d, hf = models[kind]
    want = _hf_logits(hf, PROMPT)
    assert_logits(*_plan(d), want, PROMPT)
    assert np.abs(want[1:] - want[:-1]).max() > 0.1          # no near-constant model


@pytest.mark.parametrize("kind", list(VARIANTS))
def test_greedy_16_tokens_match_hf(models, kind):
    d, hf = models[kind]
    want = hf_greedy(hf, PROMPT, 16, VOCAB - 1)
    plan, weights = _plan(d)
    assert reference_greedy(plan, weights, PROMPT, 16) == want


def test_softmax_scale_carries_yarn_mscale(models):
    import math
    plan, _ = _plan(models["plain"][0])
    m = 0.1 * 0.707 * math.log(40.0) + 1.0
    scales = {json.dumps(n.get("attrs", {}).get("scale")) for n in _nodes(plan, "latent_attention")}
    assert scales == {json.dumps((16 + 8) ** -0.5 * m * m)}


def _nodes(plan, op):
    found = []

    def walk(x):
        if isinstance(x, dict):
            if x.get("op") == op:
                found.append(x)
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)
    walk(plan["programs"])
    return found


def test_build_variant_no_compile(tmp_path):
    r = subprocess.run([sys.executable, "-m", "infc.cli", "build", "--model", "deepseek-v2-lite",
                        "--no-compile", "--out", str(tmp_path / "a")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    plan = json.loads((tmp_path / "a" / "plan.json").read_text())
    repeat = next(e for e in plan["programs"]["decode"] if "repeat" in e)
    assert repeat["schedule"] == ["dense"] + ["moe"] * 26
    assert caches.unit_elems(caches.of_plan(plan)["latent"]) == 512 + 64   # 576 values a token
    # a layer's bytes per token: 1,152 (bf16), against 16 heads x (192 + 128) x 2 = 10,240 expanded
    assert caches.token_bytes(caches.select(caches.of_plan(plan), ["latent"], [0])) == 576 * 2
