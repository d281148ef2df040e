"""Prompt logprobs on the CUDA runner, on the fake device (tests/test_cuda_ranks.py's: the plan's
kernels under the Triton interpreter): the logits tail re-launched at the prompt rows gives what
the forced-token path gives, over chunks and both with and without overlapped steps."""
import sys

import numpy as np
import pytest

from exhaustive import EXHAUSTIVE
from infc.compiler.build import build
from infc.runtime.engine.engine import Engine
from infc.runtime.engine.prompt_logprobs import PromptScore, log_softmax
from infc.runtime.engine.runner import RowSampling
from infc.runtime.engine.sampling import SamplingParams
from infc.runtime.engine.step import Chunk, build_step
from test_cuda_ranks import FakeCtx, FakeGraph, cuda_mods, fake_device, fake_launch  # noqa: F401
from prompt_scoring import assert_same, engine_scores, forced_reference


@pytest.fixture(scope="module")
def artifact(tiny_model, tmp_path_factory):
    d, _ = tiny_model("qwen3")
    out = tmp_path_factory.mktemp("prompt-logprobs-qwen3")
    build(model_dir=str(d), out=out, compile=False, log=None)
    return d, out


def runner(fake_device, artifact, monkeypatch, **kw):
    monkeypatch.setattr(fake_device.runner, "Graph", FakeGraph)
    monkeypatch.setattr(sys.modules["infc.runtime.cuda.sampler"], "launch", fake_launch)
    d, art = artifact
    kw.setdefault("buckets", [1, 2, 4])
    return fake_device.runner.CudaRunner(art, d, num_pages=24, ctx=FakeCtx(40 << 20), **kw)


def test_cuda_runner_scores_prompt_rows_as_each_prefix_last_row(fake_device, artifact, monkeypatch, rng):
    """One step scores an 8-token prompt's rows; each equals the last-row logits of a prefill of
    that prefix (one step of 7 sequences). Overlapped steps: the exhaustive case below."""
    r = runner(fake_device, artifact, monkeypatch, max_num_batched_tokens=64, max_num_seqs=8,
               cuda_graphs=False)
    ids = rng.integers(0, 320, 8).tolist()
    prefixes = build_step([Chunk(i, ids[:i + 1], 0) for i in range(7)], lambda i: [i], r.page_size)
    lp = log_softmax(r.logits(prefixes).copy())
    for how in ("execute",):
        meta = build_step([Chunk(9, ids, 0)], lambda i: [9], r.page_size)
        meta.scores = [PromptScore(1, ids[1:], 3)]
        row = [RowSampling(SamplingParams(temperature=0), 0, 0)]
        samples = r.execute(meta, row) if how == "execute" else r.collect(r.launch(meta, row))
        assert samples[0] is not None                   # its last row samples, as without scores
        got = meta.scores[0].entries
        assert [e["token"] for e in got] == ids[1:]
        for i, e in enumerate(got):
            assert abs(e["logprob"] - lp[i, ids[i + 1]]) < 2e-3, (how, i)
            assert [x for _, x in e["top"]] == pytest.approx(sorted(lp[i], reverse=True)[:3], abs=2e-3)
            assert e["rank"] == 1 + int((lp[i] > lp[i, ids[i + 1]] + 2e-3).sum()) or abs(
                np.sort(lp[i])[::-1][e["rank"] - 1] - e["logprob"]) < 2e-3
    r.close()


@EXHAUSTIVE
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
