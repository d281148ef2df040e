"""Overlapped steps on the CUDA runner, on a fake device (tests/test_cuda_ranks.py's: host memory,
the plan's kernels under the Triton interpreter, graphs replayed by re-issuing): a step launched
with its pending tokens fed on the device from the step before computes what the synchronous
runner computes, through eager programs and decode graphs, greedy and seeded sampling."""
import sys

import numpy as np
import pytest

from infc.compiler.build import build
from infc.runtime.engine.engine import Engine
from infc.runtime.engine.sampling import SamplingParams
from test_cuda_ranks import FakeCtx, FakeGraph, cuda_mods, fake_device, fake_launch  # noqa: F401


@pytest.fixture(scope="module")
def artifact(tiny_model, tmp_path_factory):
    d, _ = tiny_model("qwen3")
    out = tmp_path_factory.mktemp("overlap-qwen3")
    build(model_dir=str(d), out=out, compile=False, log=None)
    return d, out


def engine(fake_device, artifact, monkeypatch, overlap):
    monkeypatch.setattr(fake_device.runner, "Graph", FakeGraph)
    monkeypatch.setattr(sys.modules["infc.runtime.cuda.sampler"], "launch", fake_launch)
    d, art = artifact
    r = fake_device.runner.CudaRunner(art, d, max_num_batched_tokens=24, max_num_seqs=4,
                                      num_pages=24, buckets=[1, 2, 4], ctx=FakeCtx(40 << 20))
    return Engine(r, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=24, overlap=overlap)


def test_cuda_runner_overlapped_steps_give_the_synchronous_tokens(fake_device, artifact, monkeypatch, rng):
    prompts = [rng.integers(0, 320, n).tolist() for n in (9, 30, 3, 5)]
    params = [SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=4, temperature=0.9, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=3)]
    got = {}
    for overlap in (False, True):
        e = engine(fake_device, artifact, monkeypatch, overlap)
        assert e.overlap == overlap
        fed = []
        if overlap:
            launch = e.runner.launch
            e.runner.launch = lambda meta, rows, feed=(): fed.append(list(feed)) or launch(meta, rows, feed)
        for i, (p, sp) in enumerate(zip(prompts, params)):
            e.add_request(p, sp, f"r{i}")
        outs, lps = {}, {}
        replays = FakeGraph.replays
        while e.has_unfinished():
            for o in e.step():
                outs.setdefault(o.request_id, []).extend(o.token_ids)
                if o.logprobs:
                    lps.setdefault(o.request_id, []).extend(o.logprobs)
        assert FakeGraph.replays > replays                  # decode steps ran from graphs
        got[overlap] = outs, lps
        if overlap:                            # the logprobs request's steps overlap too
            assert sum(map(len, fed)) >= 12
        e.runner.close()
    assert got[True] == got[False]
    assert [len(got[True][0][f"r{i}"]) for i in range(4)] == [5, 4, 6, 4]
    assert list(got[True][1]) == ["r3"] and len(got[True][1]["r3"]) == 4
    assert all(len(lp["top"]) == 3 for lp in got[True][1]["r3"])


def test_staging_alternates_two_buffers_and_waits_for_their_copies():
    """Each step writes the other buffer, 64-byte aligned, refuses more than it holds, and waits
    for the copies from a buffer (its event) before it writes that buffer again."""
    from infc.runtime.cuda.staging import Staging
    waits = []

    class Event:
        def record(self):
            self.at = len(waits)

        def wait(self):
            waits.append(self)

    class Ctx:
        def pinned(self, n):
            return np.zeros(n, np.uint8)

        def event(self):
            return Event()
    s = Staging(Ctx(), 256)
    s.begin()
    a = s.put(np.arange(10, dtype=np.int32))
    assert a.tolist() == list(range(10)) and a.ctypes.data == s.buffers[1].ctypes.data
    b = s.put(np.ones((3, 4), np.int64))
    assert b.shape == (3, 4) and b.ctypes.data - a.ctypes.data == 64          # 64-byte aligned
    with pytest.raises(ValueError, match="more than the 256 bytes of staging"):
        s.put(np.zeros(40, np.int32))
    s.done()
    s.begin()                                  # buffer 0: never used, nothing to wait for
    c = s.put(np.zeros(40, np.int32))
    assert c.ctypes.data == s.buffers[0].ctypes.data and waits == []
    s.done()
    s.begin()                                  # buffer 1 again: step 1's copies first
    assert waits == [s.copied[1]]


def test_logprob_rows_alternate_by_step_and_grow_to_the_most_asked(fake_driver):
    """Two steps in flight may both ask for logprobs: each parity has its own page-locked rows,
    packed (only the rows asked for), grown when a step asks for more, the old ones given back."""
    from infc.runtime.cuda.sampler import GpuSampler
    s = object.__new__(GpuSampler)
    s.ctx, s.V, s.max_seqs = fake_driver.Context(), 50, 8
    s.lp_host, s._lp_pinned = [None, None], [None, None]
    a = s._lp_rows(0, 1)
    b = s._lp_rows(1, 2)
    assert a.shape == (1, 50) and b.shape == (2, 50) and len(s.ctx.pinned_live) == 2
    assert s._lp_rows(0, 1) is a                            # enough rows: the same buffer
    c = s._lp_rows(0, 3)
    assert c.shape == (3, 50) and len(s.ctx.pinned_live) == 2        # a's given back
    assert s._lp_rows(0, 20).shape == (8, 50)               # never more than max_num_seqs
