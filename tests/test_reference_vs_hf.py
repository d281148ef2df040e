"""The numpy reference executor, running the compiled plan, against HF transformers (float32,
CPU) on tiny random qwen3, llama (with Llama 3 RoPE scaling) and qwen3_moe models."""
import numpy as np
import pytest
import torch

from infc import LLM, SamplingParams
from infc.compiler.build import compile_model
from infc.compiler.pipeline import FUSIONS
from infc.runtime.reference.executor import ReferenceExecutor, SeqChunk
from infc.compiler.contract.safetensors_io import Checkpoint
from infc.runtime.weights.load import load_weights

FAMILIES = ["qwen3", "llama", "qwen3_moe"]


def executor(model_dir, skip=()):
    _, plan = compile_model(model_dir=str(model_dir), skip=skip)
    return ReferenceExecutor(plan, load_weights(plan, Checkpoint(model_dir)))


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_and_every_position(family, tiny_model, rng):
    d, hf = tiny_model(family)
    ids = [int(t) for t in rng.integers(0, 320, 16)]
    ref = hf_logits(hf, ids)
    ex = executor(d)
    last = ex.step([SeqChunk(0, ids, 0)])[0]
    assert np.abs(last - ref[-1]).max() <= 1e-3
    # the same prompt fed one token per step: logits at every position
    ex2 = executor(d)
    worst = 0.0
    for pos, t in enumerate(ids):
        got = ex2.step([SeqChunk(7, [t], pos)])[0]
        worst = max(worst, float(np.abs(got - ref[pos]).max()))
    assert worst <= 1e-3, worst


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_16_tokens_match_hf(family, tiny_model, rng):
    d, hf = tiny_model(family)
    ids = [int(t) for t in rng.integers(0, 320, 16)]
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False,
                           min_new_tokens=16, pad_token_id=0)[0, 16:].tolist()
    out = LLM(d).generate([ids], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    assert out[0].token_ids == want


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_equals_alone(family, tiny_model, rng):
    """Two sequences of different lengths in one step give each one's logits alone."""
    d, _ = tiny_model(family)
    a = [int(t) for t in rng.integers(0, 320, 13)]
    b = [int(t) for t in rng.integers(0, 320, 5)]
    together = executor(d)
    alone_a, alone_b = executor(d), executor(d)
    got = together.step([SeqChunk(0, a, 0), SeqChunk(1, b, 0)])
    assert np.abs(got[0] - alone_a.step([SeqChunk(0, a, 0)])[0]).max() <= 1e-5
    assert np.abs(got[1] - alone_b.step([SeqChunk(1, b, 0)])[0]).max() <= 1e-5
    for step in range(4):                       # decode both together, and a mixed step
        ta, tb = int(np.argmax(got[0])), int(np.argmax(got[1]))
        got = together.step([SeqChunk(0, [ta], len(a) + step), SeqChunk(1, [tb], len(b) + step)])
        ga = alone_a.step([SeqChunk(0, [ta], len(a) + step)])[0]
        gb = alone_b.step([SeqChunk(1, [tb], len(b) + step)])[0]
        assert np.abs(got[0] - ga).max() <= 1e-5
        assert np.abs(got[1] - gb).max() <= 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_mixed_step_prefill_with_decode(family, tiny_model, rng):
    """A step that prefills one sequence while another decodes (the mixed phase)."""
    d, hf = tiny_model(family)
    a = [int(t) for t in rng.integers(0, 320, 9)]
    b = [int(t) for t in rng.integers(0, 320, 6)]
    ex = executor(d)
    ex.step([SeqChunk(0, a[:-1], 0)])
    got = ex.step([SeqChunk(0, a[-1:], len(a) - 1), SeqChunk(1, b, 0)])
    assert np.abs(got[0] - hf_logits(hf, a)[-1]).max() <= 1e-3
    assert np.abs(got[1] - hf_logits(hf, b)[-1]).max() <= 1e-3


@pytest.mark.parametrize("family", FAMILIES)
def test_fusion_does_not_change_logits(family, tiny_model, rng):
    """The fused plan computes what the unfused plan computes."""
    d, _ = tiny_model(family)
    ids = [int(t) for t in rng.integers(0, 320, 11)]
    fused = executor(d).step([SeqChunk(0, ids, 0)])
    plain = executor(d, skip=tuple(FUSIONS)).step([SeqChunk(0, ids, 0)])
    assert np.abs(fused - plain).max() <= 1e-5


def test_seeded_sampling_is_reproducible(tiny_model, rng):
    d, _ = tiny_model("qwen3")
    ids = [int(t) for t in rng.integers(0, 320, 8)]
    llm = LLM(d)
    p = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    a = llm.generate([ids], p)[0].token_ids
    b = llm.generate([ids, ids[:3]], p)[0].token_ids     # other requests do not perturb it
    c = llm.generate([ids], SamplingParams(**{**p.__dict__, "seed": 8}))[0].token_ids
    assert a == b
    assert a != c


@pytest.mark.parametrize("over", [{"mlp_only_layers": [1]}, {"decoder_sparse_step": 2}],
                         ids=["mlp_only_layers", "sparse_step"])
def test_moe_with_dense_layers(over, tiny_model, rng):
    """Layer kinds with their own weights: qwen3_moe layers listed in mlp_only_layers (or off
    the decoder_sparse_step beat) are dense SwiGLU layers, the rest sparse; every position
    matches HF, and each kind loads only its own weights."""
    d, hf = tiny_model("qwen3_moe", **over)
    _, plan = compile_model(model_dir=str(d))
    sched = next(l for l in plan["programs"]["prefill"] if "repeat" in l)["schedule"]
    assert sched == ["sparse", "dense", "sparse"] if "mlp_only_layers" in over else \
        sched == ["dense", "sparse", "dense"]
    dense = [i for i, k in enumerate(sched) if k == "dense"]
    assert plan["weights"]["wgu"]["layers"] == dense
    assert plan["weights"]["router"]["layers"] == [i for i in range(3) if i not in dense]
    ids = [int(t) for t in rng.integers(0, 320, 16)]
    ref = hf_logits(hf, ids)
    ex = executor(d)
    for pos, t in enumerate(ids):
        assert np.abs(ex.step([SeqChunk(0, [t], pos)])[0] - ref[pos]).max() <= 1e-4
