"""Overlapped steps (engine.Engine, overlap): the engine launches step N + 1 before it reads step
N's samples, feeding each pending token on the device. The outputs must be those of the
synchronous engine, whatever the batch does (chunked prefill, preemption, stops, n > 1, seeded
sampling, prefix hits, aborts), no step may be wasted on a sequence whose last token is known to
be its last, and every page must come back."""
import numpy as np
import pytest

from infc.runtime.engine.engine import Engine
from infc.runtime.engine.sampling import SamplingParams
from test_scheduler import FakeRunner, assert_all_free, drain, make_engine, solo


class FeedRecorder(FakeRunner):
    """A FakeRunner that records what each launch was fed, and checks the placeholder rows."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.feeds = []

    def launch(self, meta, sampling, feed=()):
        self.feeds.append(list(feed))
        for row, _ in feed:
            assert meta.tokens[row] == 0, "a pending token's row must hold the placeholder"
        return super().launch(meta, sampling, feed)


def workload(rng, vocab=97):
    """(prompt, params) pairs that exercise every path of the engine, and the EOS id: greedy
    requests 2 and 3 meet their stop token (EOS, a stop id) a few tokens in."""
    stem = rng.integers(0, vocab, 23).tolist()
    out, eos = [], None
    for i in range(14):
        prompt = (stem if i % 3 == 0 else []) + rng.integers(0, vocab, int(rng.integers(1, 30))).tolist()
        kw = dict(max_tokens=int(rng.integers(3, 20)), temperature=0.0, ignore_eos=True)
        if i % 4 == 1:
            kw.update(temperature=0.8, seed=int(rng.integers(1 << 30)))
        greedy = solo(FakeRunner(64, page_size=4), prompt, 20)
        if i % 5 == 2:
            kw.update(ignore_eos=False, min_tokens=2)
            if eos is None:
                kw.update(max_tokens=12)
                eos = greedy[4]
        if i % 6 == 3:
            kw.update(stop_token_ids=[greedy[3]], max_tokens=12)
        if i == 7:
            kw.update(n=2, temperature=0.7, seed=11)
        out.append((prompt, SamplingParams(**kw)))
    return out, eos


def run(overlap, reqs, eos, **kw):
    r = FeedRecorder(kw.pop("num_pages"), page_size=4)
    e = make_engine(r, eos_ids=[eos], overlap=overlap, **kw)
    for i, (prompt, params) in enumerate(reqs):
        e.add_request(prompt, params, f"r{i}")
    outs = {}
    for _ in range(100_000):
        if not e.has_unfinished():
            break
        for o in e.step():
            tokens, reason = outs.get((o.request_id, o.index), ([], None))
            outs[(o.request_id, o.index)] = (tokens + o.token_ids, o.finish_reason or reason)
    assert not e.has_unfinished()
    return e, r, outs


@pytest.mark.parametrize("num_pages, budget, seqs", [(200, 64, 16), (24, 16, 6), (40, 7, 3)])
def test_overlapped_engine_gives_the_synchronous_outputs(num_pages, budget, seqs):
    """Roomy, preempting (24 pages of 4 tokens for 14 requests) and chunked (7-token budget)."""
    reqs, eos = workload(np.random.default_rng(num_pages))
    kw = dict(num_pages=num_pages, max_num_batched_tokens=budget, max_num_seqs=seqs)
    sync, r_sync, want = run(False, reqs, eos, **dict(kw))
    over, r_over, got = run(True, reqs, eos, **dict(kw))
    assert got == want and len(want) == 15
    assert {reason for _, reason in want.values()} >= {"length", "stop"}
    assert not any(r_sync.feeds) and sum(map(len, r_over.feeds)) > 20      # it did overlap
    assert_all_free(sync)
    assert_all_free(over)
    if num_pages == 24:
        assert over.scheduler.num_preemptions > 0


def test_a_known_last_token_costs_no_extra_step_and_a_stop_one():
    """max_tokens: the step that samples the last token is the last to run the sequence; a stop
    token found one step late costs one dropped row, never an output."""
    r = FeedRecorder(64, page_size=4)
    e = make_engine(r, eos_ids=[], overlap=True)
    e.add_request([5, 6, 7], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), "a")
    out = drain(e)["a"][0]
    assert len(out) == 6
    assert sum(sum(s) for _, _, s in r.steps) == 6                 # six sampling rows, no seventh

    want = FakeRunner(64, page_size=4)
    tokens = drain_one(want, [5, 6, 7], 12)
    stop = tokens[4]                                               # the fifth token stops it
    r = FeedRecorder(64, page_size=4)
    e = make_engine(r, overlap=True)
    e.add_request([5, 6, 7], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop]), "b")
    outs = []
    while e.has_unfinished():
        outs += e.step()
    assert [t for o in outs for t in o.token_ids] == tokens[:tokens.index(stop) + 1]
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == stop
    assert sum(sum(s) for _, _, s in r.steps) == tokens.index(stop) + 2     # one row dropped
    assert_all_free(e)


def drain_one(runner, prompt, n):
    e = make_engine(runner, overlap=False)
    e.add_request(prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), "x")
    return drain(e)["x"][0]


def test_abort_while_a_step_is_in_flight_drops_its_rows_and_frees_pages():
    r = FeedRecorder(64, page_size=4)
    e = make_engine(r, overlap=True)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    e.add_request([1, 2, 3], params, "keep")
    e.add_request([4, 5, 6, 7], params, "drop")
    seen = {"keep": [], "drop": []}
    for _ in range(5):
        for o in e.step():
            seen[o.request_id] += o.token_ids
    assert e.in_flight is not None
    assert e.abort("drop")
    for _ in range(200):
        if not e.has_unfinished():
            break
        for o in e.step():
            assert o.request_id == "keep"
            seen["keep"] += o.token_ids
    assert seen["keep"] == drain_one(FakeRunner(64, page_size=4), [1, 2, 3], 30)
    assert 0 < len(seen["drop"]) < 30
    assert_all_free(e)


def test_overlap_is_off_on_request_and_where_the_runner_cannot(monkeypatch):
    assert make_engine(FakeRunner(8)).overlap
    assert not make_engine(FakeRunner(8), overlap=False).overlap
    monkeypatch.setenv("INFC_OVERLAP", "0")
    assert not make_engine(FakeRunner(8)).overlap

    class Lockstep(FakeRunner):
        can_overlap = False
    monkeypatch.delenv("INFC_OVERLAP")
    assert not Engine(Lockstep(8), max_model_len=64).overlap


@pytest.mark.parametrize("overlap", [False, True])
def test_generated_blocks_enter_the_prefix_cache_once_their_tokens_are_read(overlap):
    """A follow-up turn (prompt + answer + more) hits every full block of the first turn's
    answer too: a block is hashed only once its pending token is known, never with a
    placeholder."""
    r = FeedRecorder(64, page_size=4)
    e = make_engine(r, overlap=overlap)
    prompt = [11, 12, 13, 14, 15, 16]
    e.add_request(prompt, SamplingParams(max_tokens=13, temperature=0, ignore_eos=True), "turn1")
    answer = drain(e)["turn1"][0]
    follow = prompt + answer + [40, 41]
    e.add_request(follow, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), "turn2")
    outs = []
    while e.has_unfinished():
        outs += e.step()
    # the first turn computed prompt + 12 of its 13 answers: 18 tokens, 4 full blocks of 4
    assert outs[0].num_cached_tokens == 16
    assert [t for o in outs for t in o.token_ids] == solo(FakeRunner(64, page_size=4), follow, 3)
    assert_all_free(e)


def test_without_stops_the_overlapped_engine_runs_the_synchronous_batches():
    """Only a stop found late makes the batches differ (by its dropped row): otherwise every step
    holds the same rows, prefix hits included (a block whose ids are all known is offered at
    launch, as the synchronous engine offers it before the next step). So on the GPU, where
    a batch's composition picks the kernel paths, the two engines give bit-identical tokens."""
    rng = np.random.default_rng(21)
    stem = rng.integers(0, 97, 40).tolist()
    reqs = []
    for i in range(24):
        prompt = (stem if i % 2 else []) + rng.integers(0, 97, int(rng.integers(1, 90))).tolist()
        kw = dict(max_tokens=int(rng.integers(2, 20)), temperature=0.0, ignore_eos=True)
        if i % 3 == 1:
            kw.update(temperature=0.9, top_p=0.9, seed=100 + i)
        reqs.append((prompt, SamplingParams(**kw)))
    steps, outs = [], []
    for overlap in (False, True):
        r = FeedRecorder(600, page_size=16)
        e = make_engine(r, overlap=overlap, max_num_batched_tokens=256, max_num_seqs=32)
        for i, (p, sp) in enumerate(reqs):
            e.add_request(p, sp, f"r{i}")
        outs.append(drain(e))
        steps.append(r.steps)
        assert e.bm.hit_tokens > 0
    assert steps[0] == steps[1] and outs[0] == outs[1]
