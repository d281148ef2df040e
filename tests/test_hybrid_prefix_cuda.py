"""Hybrid prefix caching over the CUDA runner on a fake device (tests/test_cuda_ranks.py's: host
memory, the plan's kernels under the Triton interpreter): the runner's snapshot pool
(runtime/cuda/state_copies.py: device-to-device copies on the steps' stream) makes a re-sent
Qwen3.5 prompt's hit give the tokens and logprobs of prefix caching off, overlapped steps
included. Slow under the interpreter: exhaustive (the fast suite's representative is
test_hybrid_prefix.py::test_snapshot_copies_on_the_device_move_the_bytes_the_host_moves)."""
import sys

import numpy as np
import pytest

from infc.compiler.build import build
from infc.runtime.engine.engine import Engine
from infc.runtime.engine.sampling import SamplingParams
from exhaustive import EXHAUSTIVE
from test_cuda_ranks import FakeCtx, FakeGraph, cuda_mods, fake_device, fake_launch  # noqa: F401
from test_kv_tier_cuda import serve


@pytest.fixture(scope="module")
def artifact(family_model, tmp_path_factory):
    d, _ = family_model("qwen3_5")
    out = tmp_path_factory.mktemp("hybrid-qwen3_5")
    build(model_dir=str(d), out=out, compile=False, log=None)
    return d, out


def engine(fake_device, artifact, monkeypatch, overlap, caching):
    monkeypatch.setattr(fake_device.runner, "Graph", FakeGraph)
    monkeypatch.setattr(sys.modules["infc.runtime.cuda.sampler"], "launch", fake_launch)
    d, art = artifact
    r = fake_device.runner.CudaRunner(art, d, max_num_batched_tokens=32, max_num_seqs=4, num_pages=24,
                                      buckets=[1, 2, 4], ctx=FakeCtx(64 << 20),
                                      num_state_snapshots=2 if caching else 0)
    return Engine(r, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=32, overlap=overlap,
                  enable_prefix_caching=caching)


@EXHAUSTIVE
def test_cuda_runner_restores_state_snapshots(fake_device, artifact, monkeypatch):
    rng = np.random.default_rng(21)
    stem = rng.integers(0, 320, 21).tolist()
    prompts = [stem, stem, stem[:17] + [5, 6]]                 # a hit at 20, then at 16 (chunked)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=0)
    e = engine(fake_device, artifact, monkeypatch, overlap=False, caching=False)
    assert e.runner.state_copies() is None and not e.bm.enable_prefix_caching
    want = serve(e, prompts, params)
    e.runner.close()
    e = engine(fake_device, artifact, monkeypatch, overlap=True, caching=True)
    assert e.overlap and e.snapshots is not None and e.snapshots.num == 2
    got = serve(e, prompts, params)
    for g, w in zip(got, want):
        assert [t for t, _ in g] == [t for t, _ in w]
        assert np.allclose([lp for _, lp in g], [lp for _, lp in w], atol=2e-3)
    assert e.bm.hit_tokens >= 20 and e.snapshots.restored >= 1
    e.runner.close()
