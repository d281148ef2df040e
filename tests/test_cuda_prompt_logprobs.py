"""Prompt logprobs on the CUDA runner, on the fake device (tests/test_cuda_ranks.py's: the plan's
kernels under the Triton interpreter): the logits tail re-launched at the prompt rows gives what
the forced-token path gives, over chunks and both with and without overlapped steps."""
import sys

import pytest

from infc.compiler.build import build
from infc.runtime.engine.engine import Engine
from test_cuda_ranks import FakeCtx, FakeGraph, cuda_mods, fake_device, fake_launch  # noqa: F401
from test_prompt_logprobs import assert_same, engine_scores, forced_reference


@pytest.fixture(scope="module")
def artifact(tiny_model, tmp_path_factory):
    d, _ = tiny_model("qwen3")
    out = tmp_path_factory.mktemp("prompt-logprobs-qwen3")
    build(model_dir=str(d), out=out, compile=False, log=None)
    return d, out


def test_cuda_runner_prompt_logprobs_equal_forced_tokens(fake_device, artifact, monkeypatch, rng):
    monkeypatch.setattr(fake_device.runner, "Graph", FakeGraph)
    monkeypatch.setattr(sys.modules["infc.runtime.cuda.sampler"], "launch", fake_launch)
    d, art = artifact

    def engine(overlap):
        r = fake_device.runner.CudaRunner(art, d, max_num_batched_tokens=8, max_num_seqs=4, num_pages=24,
                                          buckets=[1, 2, 4], ctx=FakeCtx(40 << 20))
        return Engine(r, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=8, overlap=overlap)
    prompts = [rng.integers(0, 320, 11).tolist(), rng.integers(0, 320, 5).tolist()]
    ref = engine(False)
    assert ref.scores_prompts
    want = forced_reference(ref, prompts, 2)
    ref.runner.close()
    for overlap in (False, True):
        e = engine(overlap)
        got, _ = engine_scores(e, prompts, 2)
        for g, w in zip(got, want):
            assert_same(g, w, 2e-3)                  # bf16 kernels: rows batched otherwise
        e.runner.close()
