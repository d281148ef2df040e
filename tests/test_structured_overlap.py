"""Grammar rows in the engine's schedules: the overlapped engine launches a grammar step's forward,
reads the step before back, then samples with the masks (runner.launch_forward / launch_sampling),
and gives the synchronous engine's outputs; so does a runner that cannot defer its sampling (the
step in flight is read first; data-parallel ranks likewise). Grammar outputs match and end with
"stop", n > 1 and a reasoning section included, beside unconstrained requests that pay no mask."""
import json
import re

import jsonschema
import numpy as np
import pytest

from infc.runtime.engine.engine import Engine
from infc.runtime.engine.runner import feed_tokens, sample_rows
from infc.runtime.engine.sampling import SamplingParams
from infc.runtime.engine.structured.request import StructuredOutputs
from grammar_fixtures import EOS, LogitsRunner, small_tokenizer
from test_scheduler import assert_all_free, drain, make_engine

V = 320
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
          "required": ["name", "n"], "additionalProperties": False}
REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICE = ("yes", "no", "maybe")


class Recorder(LogitsRunner):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.feeds, self.deferred, self.masked_rows = [], 0, 0

    def launch(self, meta, sampling, feed=()):
        self.feeds.append(list(feed))
        self.masked_rows += sum(s is not None and s.bitmask is not None for s in sampling)
        return super().launch(meta, sampling, feed)

    def launch_forward(self, meta, feed=()):
        self.feeds.append(list(feed))
        self.deferred += 1
        return super().launch_forward(meta, feed)

    def launch_sampling(self, step, sampling):
        self.masked_rows += sum(s is not None and s.bitmask is not None for s in sampling)
        return super().launch_sampling(step, sampling)


class NoDefer(Recorder):
    can_defer_sampling = False


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return small_tokenizer(tmp_path_factory.mktemp("small-tokenizer"))


def workload(tokenizer):
    """(prompt, params, kind) of grammar requests (greedy and seeded, n = 3, a reasoning section)
    and unconstrained ones, and the reasoning end: two tokens the fake model writes unconstrained
    after its prompt (so the constraint must start right after them)."""
    think_prompt = [9, 8, 7]
    free = run(Recorder(64, vocab_size=V), tokenizer, False,
               [(think_prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), None)])
    think = tuple(free[("r0", 0)][0][2:4])
    so = {"json": StructuredOutputs(json=json.dumps(SCHEMA)), "regex": StructuredOutputs(regex=REGEX),
          "choice": StructuredOutputs(choice=CHOICE), "think": StructuredOutputs(choice=CHOICE, start_after=think)}
    reqs = []
    for i in range(12):
        kind = ["json", "regex", "choice", None][i % 4]
        kw = dict(max_tokens=60, temperature=0.0 if i % 3 == 0 else 0.9, seed=i, ignore_eos=kind is None)
        if kind is not None:
            kw["structured_outputs"] = so[kind]
        if i == 5:
            kw.update(n=3)
        reqs.append(([7 + i, 40, 41 + i % 5] * (1 + i % 3), SamplingParams(**kw), kind))
    reqs.append((think_prompt, SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=so["think"]), "think"))
    return reqs, free[("r0", 0)][0]


def run(runner, tokenizer, overlap, reqs):
    e = make_engine(runner, tokenizer=tokenizer, eos_ids=[EOS], overlap=overlap, max_num_batched_tokens=24,
                    max_num_seqs=8)
    for i, (prompt, params, _) in enumerate(reqs):
        e.add_request(prompt, params, f"r{i}")
    outs = {}
    while e.has_unfinished():
        for o in e.step():
            ids, reason = outs.get((o.request_id, o.index), ([], None))
            outs[(o.request_id, o.index)] = (ids + o.token_ids, o.finish_reason or reason)
    assert_all_free(e)
    return outs


def test_overlapped_grammar_steps_give_the_synchronous_outputs(tokenizer):
    reqs, free = workload(tokenizer)
    sync = run(Recorder(200, vocab_size=V), tokenizer, False, reqs)
    over_runner = Recorder(200, vocab_size=V)
    over = run(over_runner, tokenizer, True, reqs)
    assert over == sync and len(sync) == 15
    assert over_runner.deferred > 10 and sum(map(len, over_runner.feeds)) > 40       # it did overlap
    assert over_runner.masked_rows > 40
    checked = 0
    for (rid, index), (ids, reason) in sync.items():
        kind = reqs[int(rid[1:])][2]
        text = tokenizer.decode([t for t in ids if t != EOS])
        if kind == "json":
            jsonschema.validate(json.loads(text), SCHEMA)
        elif kind == "regex":
            assert re.fullmatch(REGEX, text), text
        elif kind == "choice":
            assert text in CHOICE
        elif kind == "think":          # free until the reasoning end, constrained after it
            assert ids[:4] == free and tokenizer.decode([t for t in ids[4:] if t != EOS]) in CHOICE
        if kind is not None:
            assert reason == "stop", (kind, text)
            checked += 1
        else:
            assert reason == "length" and len(ids) == 60
    assert checked == 12
    # a choice is complete at its last letter: the grammar ends it ("stop"), no EOS sampled
    assert all(ids[-1] != EOS for (rid, _), (ids, _) in sync.items() if reqs[int(rid[1:])][2] == "choice")


def test_a_runner_that_cannot_defer_reads_the_step_in_flight_first(tokenizer):
    reqs, _ = workload(tokenizer)
    want = run(Recorder(200, vocab_size=V), tokenizer, False, reqs)
    r = NoDefer(200, vocab_size=V)
    assert run(r, tokenizer, True, reqs) == want
    assert r.deferred == 0 and r.masked_rows > 40


def test_steps_without_grammar_rows_launch_as_before(tokenizer):
    r = Recorder(200, vocab_size=V)
    reqs = [(p, sp, k) for p, sp, k in workload(tokenizer)[0] if k is None]
    run(r, tokenizer, True, reqs)
    assert r.deferred == 0 and r.masked_rows == 0 and sum(map(len, r.feeds)) > 20


class TwoRanks:
    """Two data-parallel ranks (launch_ranks / collect_ranks, no deferred sampling): each row's
    logits a function of its last token and position, sampled by the numpy sampler."""
    can_overlap, dp_world = True, 2

    def __init__(self):
        self.num_pages, self.page_size, self.vocab_size = 512, 4, V
        self._last = None
        self.launches = 0

    def execute_ranks(self, metas, sampling):
        return [sample_rows(np.stack([np.random.default_rng((int(m.tokens[i]), int(m.positions[i])))
                                      .standard_normal(V) for i in m.last_rows]).reshape(m.B, V), s)
                for m, s in zip(metas, sampling)]

    def launch_ranks(self, metas, sampling, feeds):
        for r, (m, feed) in enumerate(zip(metas, feeds)):
            feed_tokens(m, feed, self._last[r] if feed else None)
        self.launches += 1
        self._last = self.execute_ranks(metas, sampling)
        return self._last

    @staticmethod
    def collect_ranks(handle):
        return handle


def test_data_parallel_ranks_read_the_step_in_flight_before_a_grammar_step(tokenizer):
    reqs, _ = workload(tokenizer)
    outs = []
    for overlap in (False, True):
        r = TwoRanks()
        e = Engine(r, tokenizer, [EOS], max_model_len=512, max_num_seqs=8, max_num_batched_tokens=24,
                   overlap=overlap)
        assert e.overlap == overlap
        for i, (prompt, params, _) in enumerate(reqs):
            e.add_request(prompt, params, f"r{i}")
        assert {s.rank for q in e.requests.values() for s in q.seqs} == {0, 1}
        outs.append(drain(e))
        assert (r.launches > 0) == overlap
    assert outs[0] == outs[1]
    for i, (_, _, kind) in enumerate(reqs):
        if kind == "regex":
            assert all(re.fullmatch(REGEX, tokenizer.decode([t for t in ids if t != EOS]))
                       for ids in outs[1][f"r{i}"].values())


def test_a_rejected_token_fails_its_request_alone_overlapped(tokenizer, monkeypatch):
    """A grammar that refuses a token read back (a matcher's error) fails that request, even with
    the next step's sampling issued before the stop checks (Engine._collect's `then`); the others
    give the synchronous outputs."""
    reqs, _ = workload(tokenizer)
    want = run(Recorder(200, vocab_size=V), tokenizer, False, reqs)
    from infc.runtime.engine.structured import matcher
    accept = matcher.SequenceGrammar.accept
    seen = {"n": 0}

    def flaky(self, tok):
        seen["n"] += 1
        if seen["n"] == 7:
            self.broken = True
        if getattr(self, "broken", False):
            raise ValueError("the grammar refused a token")
        return accept(self, tok)
    monkeypatch.setattr(matcher.SequenceGrammar, "accept", flaky)
    got = run(Recorder(200, vocab_size=V), tokenizer, True, reqs)
    errors = [k for k, (_, reason) in got.items() if reason == "error"]
    assert len(errors) == 1
    assert {k: v for k, v in got.items() if k[0] != errors[0][0]} == {k: v for k, v in want.items() if k[0] != errors[0][0]}
