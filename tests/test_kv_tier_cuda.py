"""The KV tiers over the CUDA runner on a fake device (tests/test_cuda_ranks.py's: host memory,
the plan's kernels under the Triton interpreter): blocks saved from the device's pages to the
pinned slab and restored through runtime/cuda/kv_copies.py (2D copies on a copy stream, event
fences) give the tokens and logprobs the runner gives without tiers, overlapped steps included.
A minute under the interpreter: exhaustive (the fast suite's representative is
test_kv_tier.py::test_device_blocks_move_the_same_bytes_as_host_blocks)."""
import ctypes
import sys

import numpy as np
import pytest
import torch

from infc.compiler.build import build
from infc.runtime.engine.engine import Engine
from infc.runtime.engine.kv_tier.tiers import OffloadConfig
from infc.runtime.engine.sampling import SamplingParams
from exhaustive import EXHAUSTIVE
from test_cuda_ranks import FakeCtx, FakeGraph, cuda_mods, fake_device, fake_launch  # noqa: F401


class Event:
    def __init__(self, log):
        self.log, self.recorded = log, None

    def record(self, stream=None):
        self.recorded = stream or "main"
        self.log.append(("record", self, self.recorded))

    def wait(self):
        assert self.recorded, "host wait on an event never recorded"

    def ms_since(self, start):
        return 1.0


class TierCtx(FakeCtx):
    """FakeCtx with the copy stream's calls, logged in order (one timeline: copies land at once)."""

    def __init__(self, nbytes):
        super().__init__(nbytes)
        self.log = []

    def event(self):
        return Event(self.log)

    def new_stream(self):
        return "copy-stream"

    def wait_event(self, event, stream=None):
        assert event.recorded, "a stream waits for an event never recorded"
        self.log.append(("wait", event, stream or "main"))

    def copy2d(self, dst, dst_pitch, src, src_pitch, width, height, to_host, stream=None):
        assert stream == "copy-stream", "tier copies run on the copy stream"
        for i in range(height):
            d, s = dst + i * dst_pitch, src + i * src_pitch
            if to_host:
                ctypes.memmove(d, self._at(s, width).numpy().ctypes.data, width)
            else:
                self._at(d, width).copy_(torch.frombuffer(bytearray(ctypes.string_at(s, width)), dtype=torch.uint8))
        self.log.append(("copy", to_host, height))


def serve(engine, prompts, params) -> list:
    """Each prompt alone, in order: its tokens and their logprobs (a wrong restore moves them)."""
    out = []
    for i, p in enumerate(prompts):
        engine.add_request(p, params, f"r{i}")
        got = []
        while engine.has_unfinished():
            got += [(t, lp["logprob"]) for o in engine.step() for t, lp in zip(o.token_ids, o.logprobs)]
        out.append(got)
    return out


@pytest.fixture(scope="module")
def artifact(tiny_model, tmp_path_factory):
    d, _ = tiny_model("qwen3")
    out = tmp_path_factory.mktemp("kvtier-qwen3")
    build(model_dir=str(d), out=out, compile=False, log=None)
    return d, out


def engine(fake_device, artifact, monkeypatch, overlap, offload=None):
    monkeypatch.setattr(fake_device.runner, "Graph", FakeGraph)
    monkeypatch.setattr(sys.modules["infc.runtime.cuda.sampler"], "launch", fake_launch)
    d, art = artifact
    r = fake_device.runner.CudaRunner(art, d, max_num_batched_tokens=32, max_num_seqs=4, num_pages=14,
                                      buckets=[1, 2, 4], ctx=TierCtx(40 << 20))
    return Engine(r, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=32, overlap=overlap,
                  kv_offloading=offload)


@EXHAUSTIVE
def test_cuda_runner_restores_blocks_from_the_host_tier(fake_device, artifact, monkeypatch):
    rng = np.random.default_rng(21)
    stems = [rng.integers(0, 320, 48).tolist() for _ in range(4)]     # 3 blocks each; 14 pages
    prompts = [s + [7] for s in stems] + [stems[0] + [8, 9], stems[1] + [10]]   # A, B evicted by C, D
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, logprobs=0)
    e = engine(fake_device, artifact, monkeypatch, overlap=False)
    want = serve(e, prompts, params)
    e.runner.close()
    e = engine(fake_device, artifact, monkeypatch, overlap=True, offload=OffloadConfig(0.002))
    assert e.overlap and e.tiers is not None
    assert serve(e, prompts, params) == want          # tokens and their logprobs, exactly
    st = e.tiers.stats
    assert st.host_hit_tokens > 0 and st.bytes_to_device > 0
    log = e.runner.ctx.log
    loads = [i for i, x in enumerate(log) if x[0] == "copy" and not x[1]]
    assert loads
    for i in loads:                         # a restore: the step after it waits for it
        after = [x for x in log[i:] if x[0] == "wait" and x[2] == "main"]
        assert after, "no step waits for the restore"
    e.runner.close()


def test_step_series_splits_each_step_by_its_events(fake_device, artifact, monkeypatch):
    """bench throughput --step-series on the CUDA runner: the runner records its marks inside each
    overlapped step, in stream order start, (the step's uploads) uploaded, forward, sampling, (the
    sampler's kernels, which write the tokens where the host reads them: no copy) end, so a part is
    the time between two of them (InFlight.parts_ms), and every step of the series carries its
    parts."""
    from infc.bench.throughput import run_point
    from infc.runtime.cuda.runner import MARKS, PARTS
    e = engine(fake_device, artifact, monkeypatch, overlap=True)
    r = e.runner
    for name in ("htod", "dtoh"):                    # the copies on the main stream, in the log too
        def logged(*a, _name=name, _f=getattr(r.ctx, name)):
            r.ctx.log.append((_name, None, "main"))
            return _f(*a)
        monkeypatch.setattr(r.ctx, name, logged)
    sampler_launch = r.sampler._launch
    monkeypatch.setattr(r.sampler, "_launch", lambda *a: (r.ctx.log.append(("kernel", None, "main")),
                                                           sampler_launch(*a)))
    assert r.sampler.token_writes
    p = run_point(e, r.vocab_size, 2, 6, 3, np.random.default_rng(3), total=2, series=True)
    assert r.step_marks is False and r._marks is not None           # on for the point only
    series = p["step_series"]
    assert series and all(s[7] is not None and tuple(s[7]) == PARTS for s in series)
    names = {id(ev): m for marks in r._marks for m, ev in marks.items()}
    names.update({id(ev): ("start", "end")[i % 2] for i, ev in enumerate(r._events)})
    order = [names[id(x[1])] if x[0] == "record" else x[0] for x in r.ctx.log
             if x[2] == "main" and (x[0] in ("htod", "dtoh", "kernel") or id(x[1]) in names)]
    steps = " ".join(order).split("start")[1:]
    assert steps
    for s in steps:
        marks = [w for w in s.split() if w not in ("htod", "dtoh", "kernel")]
        assert marks == [*MARKS, "end"], s
        up, rest = s.split("uploaded")
        assert "htod" in up and "dtoh" not in s and "htod" not in rest, s
        assert "kernel" in rest.split("sampling")[1] and "kernel" not in rest.split("sampling")[0], s
    r.close()
