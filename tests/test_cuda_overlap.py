"""Overlapped steps on the CUDA runner, on a fake device (tests/test_cuda_ranks.py's: host memory,
the plan's kernels under the Triton interpreter, graphs replayed by re-issuing): a step launched
with its pending tokens fed on the device from the step before computes what the synchronous
runner computes, through eager programs and decode graphs, greedy and seeded sampling, and with
grammar rows (structured outputs) sampled after their masks."""
import re
import sys

import numpy as np
import pytest
import torch

from infc.compiler.build import build
from infc.runtime.engine.engine import Engine
from infc.runtime.engine.logits_process import unpack_bitmask as allowed
from infc.runtime.engine.sampling import SamplingParams
from infc.runtime.engine.structured.request import StructuredOutputs
from exhaustive import EXHAUSTIVE
from grammar_fixtures import EOS, small_tokenizer
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


def test_weights_streamed_beside_the_graph_capture_give_the_same_tokens(fake_device, artifact, monkeypatch, rng):
    """INFC_LOAD_OVERLAP=1: the checkpoint streams in a thread of its own while the runner
    allocates its caches and captures its graphs; the runner waits for it after the captures and
    only then runs its load program (the derived weights), and the tokens equal a runner that
    loaded first."""
    from infc.runtime.cuda import weights as dw
    prompts = [rng.integers(0, 320, n).tolist() for n in (9, 30, 3)]
    runner_cls = fake_device.runner.CudaRunner
    order = []
    for owner, name in ((runner_cls, "_capture"), (runner_cls, "_derive_weights"), (dw.DeviceWeights, "wait")):
        orig = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda self, *a, _o=orig, _n=name: order.append(_n) or _o(self, *a))
    got = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("INFC_LOAD_OVERLAP", flag)
        order.clear()
        e = engine(fake_device, artifact, monkeypatch, overlap=True)
        assert not e.runner.weights.loading
        first = order.index("_derive_weights")
        if flag == "1":
            assert order[first - 1] == "wait" and order.index("_capture") < first, order
        else:
            assert first == 0 and "wait" not in order, order
        for i, p in enumerate(prompts):
            e.add_request(p, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), f"r{i}")
        outs = {}
        while e.has_unfinished():
            for o in e.step():
                outs.setdefault(o.request_id, []).extend(o.token_ids)
        got[flag] = outs
        e.runner.close()
    assert got["1"] == got["0"] and all(len(t) == 5 for t in got["1"].values())


def test_a_short_step_of_one_sequence_replays_its_graph(fake_device, artifact, monkeypatch, rng):
    """INFC_SHORT_GRAPHS=1: the first short step of one sequence at a given T runs eagerly and is
    captured; the next at that T replays the graph (the same greedy tokens as with the flag off:
    a prefix hit's few new tokens over another cached prompt); a short step of two sequences
    stays eager."""
    base = rng.integers(0, 320, 16).tolist()
    hits = [base + rng.integers(0, 320, 5).tolist() for _ in range(3)]   # 16 cached + 5 new: T = 5
    greedy = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    got = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("INFC_SHORT_GRAPHS", flag)
        e = engine(fake_device, artifact, monkeypatch, overlap=False)
        outs = []
        for i, p in enumerate([base] + hits):
            e.add_request(p, greedy, f"r{i}")
            replays = FakeGraph.replays
            toks = []
            while e.has_unfinished():
                for o in e.step():
                    toks += o.token_ids
            outs.append((toks, FakeGraph.replays - replays))
        keys = set(e.runner.short_graphs)
        e.add_request(rng.integers(0, 320, 7).tolist(), greedy, "a")       # two prompts in one step
        e.add_request(rng.integers(0, 320, 6).tolist(), greedy, "b")
        while e.has_unfinished():
            e.step()
        assert set(e.runner.short_graphs) == keys           # B = 2: not captured
        got[flag] = [t for t, _ in outs]
        if flag == "1":
            assert keys == {(5, 1), (16, 1)}, keys               # the first prompt's step, the hits'
            # each request's decode steps replay the decode graphs (2 a request); the 2nd and 3rd
            # hits' short step replays its graph too
            assert [n for _, n in outs] == [2, 2, 3, 3], outs
        else:
            assert keys == set()
        e.runner.close()
    assert got["1"] == got["0"] and all(len(t) == 3 for t in got["1"])


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


REGEX = r"[0-9]{2}-[a-z]{2}"


@pytest.fixture(scope="module")
def small_tok(tmp_path_factory):
    return small_tokenizer(tmp_path_factory.mktemp("small-tokenizer"))


def grammar_engine(fake_device, artifact, tok, monkeypatch, overlap, seen):
    """engine() with a tokenizer, and the sampler's start masking the rows' logits first: the
    stand-in for runtime/cuda/sampler.py's device kernel that applies RowSampling.bitmask."""
    monkeypatch.setattr(fake_device.runner, "Graph", FakeGraph)
    sampler = sys.modules["infc.runtime.cuda.sampler"]
    monkeypatch.setattr(sampler, "launch", fake_launch)
    start = sampler.GpuSampler.start

    def masked_start(self, logits_ptr, rows):
        logits = self.ctx._at(logits_ptr, 4 * len(rows) * self.V).view(torch.float32).numpy().reshape(len(rows), self.V)
        for b, s in enumerate(rows):
            if s is not None and s.bitmask is not None:
                logits[b, ~allowed(s.bitmask, self.V)] = -np.inf
        seen.append([s is not None and s.bitmask is not None for s in rows])
        return start(self, logits_ptr, rows)
    monkeypatch.setattr(sampler.GpuSampler, "start", masked_start)
    d, art = artifact
    # eager steps only: the graphs' replay is the test above's (capturing them costs the most here)
    r = fake_device.runner.CudaRunner(art, d, max_num_batched_tokens=24, max_num_seqs=4,
                                      num_pages=24, cuda_graphs=False, ctx=FakeCtx(40 << 20))
    return Engine(r, tok, [EOS], max_model_len=256, max_num_seqs=4, max_num_batched_tokens=24, overlap=overlap)


@EXHAUSTIVE      # ~20 CPU-s of interpreted kernels; the fast suite covers the engine's side with
                # ComputedAtLaunch runners (test_structured_overlap.py) and launch_forward /
                # launch_sampling through every overlapped launch of the test above
def test_cuda_runner_samples_grammar_rows_with_their_masks_overlapped(fake_device, artifact, small_tok,
                                                                     monkeypatch, rng):
    """Every row sampled under a grammar is handed to the sampler with its bitmask; overlapped,
    its step's forward launches first and its sampling once the step before is read back; the
    tokens are the synchronous engine's, and match the grammar."""
    tok = small_tok
    so = StructuredOutputs(regex=REGEX)
    prompts = [rng.integers(0, 290, n).tolist() for n in (9, 5, 3)]
    params = [SamplingParams(max_tokens=8, temperature=0, structured_outputs=so),
              SamplingParams(max_tokens=8, temperature=0.9, seed=3, structured_outputs=so),
              SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)]
    got = {}
    for overlap in (False, True):
        seen = []
        e = grammar_engine(fake_device, artifact, tok, monkeypatch, overlap, seen)
        deferred = []
        if overlap:
            forward = e.runner.launch_forward
            e.runner.launch_forward = lambda meta, feed=(): deferred.append(1) or forward(meta, feed)
        for i, (p, sp) in enumerate(zip(prompts, params)):
            e.add_request(p, sp, f"r{i}")
        outs = {}
        while e.has_unfinished():
            for o in e.step():
                assert o.error is None, o.error
                ids, reason = outs.get(o.request_id, ([], None))
                outs[o.request_id] = (ids + o.token_ids, o.finish_reason or reason)
        got[overlap] = outs
        assert sum(map(sum, seen)) >= 6                      # the grammar rows came with masks
        assert all(not row[2] for row in seen if len(row) > 2)   # the plain request's never did
        if overlap:
            assert len(deferred) >= 3
        e.runner.close()
    assert got[True] == got[False]
    for rid in ("r0", "r1"):
        ids, reason = got[True][rid]
        assert reason == "stop" and re.fullmatch(REGEX, tok.decode(ids)), (ids, tok.decode(ids))
    assert got[True]["r2"][1] == "length"


def test_short_graphs_by_context_keep_a_graph_a_context_range(fake_device, artifact, monkeypatch, rng):
    """INFC_SHORT_GRAPHS_BY_CONTEXT=1: a prefix hit's short step at the same T over a short and a
    long cached prompt captures two graphs (the context's power of two in the key), each replayed
    by a later hit of its range; the tokens are those of eager steps."""
    greedy = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    bases = [rng.integers(0, 320, 16).tolist(), rng.integers(0, 320, 48).tolist()]
    prompts = bases + [b + rng.integers(0, 320, 5).tolist() for b in bases for _ in range(2)]
    got = {}
    for by in ("0", "1"):
        monkeypatch.setenv("INFC_SHORT_GRAPHS", "1")
        monkeypatch.setenv("INFC_SHORT_GRAPHS_BY_CONTEXT", by)
        e = engine(fake_device, artifact, monkeypatch, overlap=False)
        outs = []
        for i, p in enumerate(prompts):
            e.add_request(p, greedy, f"r{i}")
            while e.has_unfinished():
                for o in e.step():
                    outs += o.token_ids
        got[by] = outs
        hits = {k for k in e.runner.short_graphs if k[0] == 5}
        assert hits == ({(5, 1, 5), (5, 1, 6)} if by == "1" else {(5, 1)}), hits   # contexts 21, 53
        e.runner.close()
    assert got["1"] == got["0"]
