"""Two families infc ships through the norm and activation vocabulary of issue 45, against
transformers on tiny random float32 checkpoints that transformers itself makes and saves:

- OLMo (specs/olmo.yaml): non-parametric LayerNorms (`layer_norm(x, eps=e)`: no weight, no bias)
  and q/k/v clipped with clamp (clip_qkv small enough to bite), a layer kind; the same weights with
  clip_qkv null run no clamp;
- Apertus (specs/apertus.yaml): xIELU with its per-layer trained alpha_p / alpha_n (random here,
  so that a wrong softplus or a swapped pair moves the logits), per-head q/k RMSNorms.

The reference executor must give HF's logits at every position of a 16-token prompt within 1e-4
(16 prefixes in one step); the fused plans through their Triton kernels under the interpreter
(one prefill) stay within bf16's distance of it (@EXHAUSTIVE: the weightless norms' and xIELU's
kernels are checked alone in tests/kernels/test_norm_vocabulary.py)."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from infc.compiler.build import build, compile_model
from infc.compiler.contract.safetensors_io import Checkpoint
from infc.runtime.engine.step import Chunk
from infc.runtime.reference.executor import ReferenceExecutor, SeqChunk
from infc.runtime.weights.load import load_weights

from exhaustive import EXHAUSTIVE

VOCAB = 320
TOL = 1e-4
PROMPT = [int(t) for t in np.random.default_rng(5).integers(0, VOCAB, 16)]
BASE = dict(vocab_size=VOCAB, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            initializer_range=0.05, tie_word_embeddings=False)


def _olmo(clip):
    from transformers import OlmoConfig, OlmoForCausalLM
    return OlmoForCausalLM(OlmoConfig(**{**BASE, "hidden_size": 128}, clip_qkv=clip,     # head_dim 32
                                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0}))


def _apertus():
    from transformers import ApertusConfig, ApertusForCausalLM
    m = ApertusForCausalLM(ApertusConfig(**BASE, head_dim=32, rms_norm_eps=1e-6, dtype=torch.float32))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif "alpha" in name:          # trained values of both signs, different per layer
                p.copy_(torch.randn(p.shape, generator=gen))
    return m


MAKERS = {"olmo": lambda: _olmo(0.6), "apertus": _apertus}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for kind, maker in MAKERS.items():
        torch.manual_seed(77)
        d = tmp_path_factory.mktemp(kind)
        hf = maker().float().eval()
        hf.set_attn_implementation("eager")
        hf.save_pretrained(d)
        out[kind] = (d, hf)
    return out


def _logits(hf, ids):
    with torch.no_grad():
        return hf(input_ids=torch.tensor([ids])).logits[0].float().numpy()


def _check(d, want):
    _, plan = compile_model(model_dir=str(d))
    weights = load_weights(plan, Checkpoint(d))
    got = ReferenceExecutor(plan, weights).step([SeqChunk(k, PROMPT[:k], 0) for k in range(1, len(PROMPT) + 1)])
    err = np.abs(got - want).max(axis=1)
    assert err.max() <= TOL, f"worst position {int(err.argmax())}, |diff| {err.max():.2e}"
    return plan


def _ops(plan) -> list:
    return [n.split('"')[1] for n in json.dumps(plan["programs"]["prefill"]).split('"op": ')[1:]]


@pytest.mark.parametrize("kind", list(MAKERS))
def test_logits_match_hf(models, kind):
    d, hf = models[kind]
    plan = _check(d, _logits(hf, PROMPT))
    ops = _ops(plan)
    if kind == "olmo":
        assert "layer_norm" in ops and "clamp" in ops
        assert all(len(w["shape"]) > 1 for w in plan["weights"].values()), "a norm weight in a weightless model"
    else:
        assert "xielu" in ops


@EXHAUSTIVE
def test_olmo_unclipped_runs_no_clamp(models, tmp_path):
    """The same checkpoint with clip_qkv null: HF's unclipped model, and no clamp launched."""
    d, hf = models["olmo"]
    for f in d.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((d / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "clip_qkv": None}))
    hf.config.clip_qkv = None
    try:
        want = _logits(hf, PROMPT)
    finally:
        hf.config.clip_qkv = cfg["clip_qkv"]
    assert np.abs(want - _logits(hf, PROMPT)).max() > 1e-3          # the clip bites at 0.6
    assert "clamp" not in _ops(_check(tmp_path, want))


@pytest.mark.parametrize("kind", [pytest.param(k, marks=EXHAUSTIVE) for k in MAKERS])
def test_through_kernels(models, kind, tmp_path):
    from interp_executor import InterpExecutor
    d, _ = models[kind]
    out = build(model_dir=str(d), out=tmp_path / "art", compile=False, log=None, page_size=16)
    plan = json.loads((out / "plan.json").read_text())
    plan["_dir"] = str(out)
    weights = load_weights(plan, Checkpoint(d))
    got = InterpExecutor(plan, weights, page_size=16).step([Chunk(0, PROMPT, 0)])
    want = ReferenceExecutor(plan, weights).step([SeqChunk(0, PROMPT, 0)])
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-2


APERTUS_SPEC = Path(__file__).resolve().parent.parent / "specs" / "apertus.yaml"


@pytest.mark.parametrize("old,new,message", [
    # an activation with the config's constants that does not exist: the error names the op
    ("xielu(linear(h2, wu)", "xielu2(linear(h2, wu)", "unknown op 'xielu2'"),
    # an argument the op does not have
    ("alpha_n, xielu_beta, xielu_eps)", "alpha_n, xielu_beta, xielu_eps, gamma=1.0)",
     "xielu has no parameter 'gamma'"),
    # a trained parameter declared with the wrong shape
    ("mlp.act_fn.alpha_n\", shape: [1]}", "mlp.act_fn.alpha_n\", shape: [H]}", "xielu alpha_n must be one value, shape [1], got bf16[96]"),
    ("- h = rms_norm(x, attn_norm, eps)", "- h = rms_norm(x, attn_norm)", "rms_norm is missing argument(s) eps"),
    ("rms_norm(last(x), final_norm, eps)", "normalize(last(x), eps=-1.0)", "normalize eps must be a number >= 0"),
])
def test_spec_errors_name_the_op_or_argument(models, tmp_path, old, new, message):
    from infc.compiler.contract.errors import SpecError
    d, _ = models["apertus"]
    text = APERTUS_SPEC.read_text()
    assert old in text
    spec = tmp_path / "apertus.yaml"
    spec.write_text(text.replace(old, new, 1))
    with pytest.raises(SpecError) as e:
        compile_model(model_dir=str(d), spec_path=str(spec))
    assert message in str(e.value), str(e.value)


@pytest.mark.parametrize("kind", [pytest.param("olmo", marks=EXHAUSTIVE), "apertus"])
def test_tensor_parallel_ranks_give_the_single_rank_logits(models, kind):
    """clamp and xielu shard with their block (xielu's alphas whole on each rank), the weightless
    norms stay replicated: two simulated ranks give the single-rank logits, and the MLP is split."""
    from infc.compiler.build import compile_ranks
    from infc.compiler.parallel import settings
    from infc.runtime.reference.ranks import RankExecutor
    d, _ = models[kind]
    _, plan = compile_model(model_dir=str(d))
    one = ReferenceExecutor(plan, load_weights(plan, Checkpoint(d)))
    plans = [p for _, p in compile_ranks(settings(tensor_parallel_size=2), model_dir=str(d))]
    assert plans[0]["weights"]["wd"]["shape"] == [plan["weights"]["wd"]["shape"][0], 80]     # half of F = 160
    many = RankExecutor(plans, [load_weights(p, Checkpoint(d)) for p in plans])
    step = [SeqChunk(0, PROMPT, 0)]
    assert np.abs(many.step(step) - one.step(step)).max() <= TOL
