"""Scheduler under pressure: token budget and decode-first mixed steps, chunked prefill, KV
exhaustion with preemption by recompute (a tiny real model: outputs equal each request alone),
1,000 requests with random aborts, and requests that can never fit.

FakeRunner stands in for a model where speed matters: it writes each token and its position
into the KV slot the step metadata names, reads the whole context back through the block
table, and answers a token that depends on all of it, so a page mix-up changes the output."""
import zlib

import numpy as np
import pytest

from infc.compiler.build import compile_model
from infc.runtime.engine.block_manager import BlockManager
from infc.runtime.engine.engine import Engine
from infc.runtime.engine.runner import ComputedAtLaunch, CPURunner, Sample
from infc.compiler.contract.safetensors_io import Checkpoint
from infc.runtime.engine.sampling import SamplingParams
from infc.runtime.engine.scheduler import Scheduler
from infc.runtime.engine.sequence import Sequence
from infc.runtime.weights.load import load_weights


class FakeRunner(ComputedAtLaunch):
    def __init__(self, num_pages: int, page_size: int = 4, vocab_size: int = 97, next_token=None):
        self.num_pages, self.page_size, self.vocab_size = num_pages, page_size, vocab_size
        self.kv_tok = np.full(num_pages * page_size, -1, np.int64)
        self.kv_pos = np.full(num_pages * page_size, -1, np.int64)
        self.next_token = next_token or self.context_hash
        self.bm = None                  # set by make_engine: written pages must be exclusive
        self.steps = []                 # (phase, tokens per row, samples per row)

    def context_hash(self, ctx) -> int:
        return zlib.crc32(np.asarray(ctx, np.int64).tobytes()) % self.vocab_size

    def contexts(self, meta) -> list:
        """Write the step's tokens to their KV slots; each row's context read back through its
        block table."""
        ps, slots = self.page_size, meta.slot_mapping
        assert len(set(slots.tolist())) == len(slots), "two rows write one KV slot"
        if self.bm is not None:
            for page in set((slots // ps).tolist()):
                b = self.bm.blocks[page]
                assert b.ref == 1 and b.hash is None, f"writing shared or cached page {page}"
        self.kv_tok[slots], self.kv_pos[slots] = meta.tokens, meta.positions
        out = []
        for b in range(meta.B):
            p = np.arange(meta.context_lens[b])
            where = meta.block_tables[b][p // ps] * ps + p % ps
            assert (self.kv_pos[where] == p).all(), "context read from the wrong slots"
            out.append(self.kv_tok[where])
        return out

    def execute(self, meta, sampling):
        return self.sample_contexts(meta, self.contexts(meta), sampling)

    def sample_contexts(self, meta, contexts, sampling):
        self.steps.append((meta.phase, np.diff(meta.seq_starts).tolist(), [s is not None for s in sampling]))
        out = []
        for ctx, s in zip(contexts, sampling):
            if s is None:
                out.append(None)
                continue
            tok = self.next_token(ctx)
            if s.params.temperature > 0:
                tok = (tok + int(np.random.default_rng((s.seed, s.step)).integers(self.vocab_size))) % self.vocab_size
            while tok in s.banned:
                tok = (tok + 1) % self.vocab_size
            lp = None if s.params.logprobs is None else -1.0
            out.append(Sample(tok, lp, None if lp is None else [(tok, lp)]))
        return out


def make_engine(runner, **kw):
    kw.setdefault("max_model_len", 1 << 20)
    e = Engine(runner, **kw)
    if isinstance(runner, FakeRunner):
        runner.bm = e.bm
    return e


def drain(engine, max_steps=100_000):
    outs = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return outs
        for o in engine.step():
            outs.setdefault(o.request_id, {}).setdefault(o.index, []).extend(o.token_ids)
    raise AssertionError("the engine did not finish")


def solo(runner, prompt, n):
    ctx = list(prompt)
    for _ in range(n):
        ctx.append(runner.next_token(np.asarray(ctx)))
    return ctx[len(prompt):]


def assert_all_free(engine):
    bm = engine.bm
    bm.check()
    assert not engine.scheduler.running and not engine.scheduler.waiting and not engine.requests
    assert all(b.ref == 0 for b in bm.blocks)
    assert bm.num_free_pages == bm.num_pages


GREEDY = dict(temperature=0, ignore_eos=True)


def test_budget_decodes_first_and_chunked_prefill():
    r = FakeRunner(64)
    e = make_engine(r, max_num_batched_tokens=8, max_num_seqs=4)
    prompts = [[1, 2, 3], [4, 5], [6] * 30, [7, 8, 9, 10]]
    for i, p in enumerate(prompts):
        e.add_request(p, SamplingParams(max_tokens=6, **GREEDY), f"r{i}")
    outs = drain(e)
    for i, p in enumerate(prompts):
        assert outs[f"r{i}"][0] == solo(r, p, 6)
    assert all(sum(rows) <= 8 for _, rows, _ in r.steps)
    assert any(phase == "mixed" for phase, _, _ in r.steps)
    # the 30-token prompt is spread over several steps and samples only at its end
    chunked = [(rows, smp) for _, rows, smp in r.steps if any(n > 1 and not s for n, s in zip(rows, smp))]
    assert len(chunked) >= 3
    assert_all_free(e)


def test_schedule_order_decodes_then_prefill_chunks_then_admissions():
    bm = BlockManager(64, 4)
    sch = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=10)
    seqs = [Sequence(i, f"r{i}", 0, list(range(1, 3 + i)) if i != 1 else [5] * 30,
                     SamplingParams(), 0) for i in range(5)]
    for q in seqs[:4]:
        sch.add(q)

    def step():
        batch = sch.schedule()
        for q, n in batch:                       # what the engine does after the step
            q.num_computed_tokens += n
            if q.num_computed_tokens == q.num_tokens:
                q.token_ids.append(7)
        return [(q.seq_id, n) for q, n in batch]

    assert step() == [(0, 2), (1, 8)]            # FCFS admission until the budget is spent
    assert step() == [(0, 1), (1, 9)]            # the decode, then the running prefill's chunk
    sch.add(seqs[4])
    assert step() == [(0, 1), (1, 9)]            # nobody admitted while the budget is spent
    assert step() == [(0, 1), (1, 4), (2, 4), (3, 1)]       # 1 samples; 2 and 3 admitted
    assert step() == [(0, 1), (1, 1), (2, 1), (3, 4), (4, 3)]
    assert [q.num_output_tokens for q in seqs] == [5, 2, 2, 1, 0]


def test_max_num_seqs_bounds_a_step():
    r = FakeRunner(64)
    e = make_engine(r, max_num_seqs=3)
    for i in range(7):
        e.add_request([i + 1, i + 2], SamplingParams(max_tokens=4, **GREEDY), f"r{i}")
    outs = drain(e)
    assert max(len(rows) for _, rows, _ in r.steps) == 3
    assert all(outs[f"r{i}"][0] == solo(r, [i + 1, i + 2], 4) for i in range(7))
    assert_all_free(e)


def test_request_that_can_never_fit_is_rejected():
    e = make_engine(FakeRunner(4), max_model_len=1000)          # 16 tokens of KV
    with pytest.raises(ValueError, match="can never fit"):
        e.add_request([1] * 10, SamplingParams(max_tokens=8))
    with pytest.raises(ValueError, match="can never fit"):
        e.add_request([1] * 10, SamplingParams(max_tokens=None))
    e.add_request([1] * 10, SamplingParams(max_tokens=7, **GREEDY))   # 16 tokens, 15 in the KV
    with pytest.raises(ValueError, match="maximum context length"):
        make_engine(FakeRunner(64), max_model_len=8).add_request([1] * 8, SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        e.add_request([], SamplingParams())
    with pytest.raises(ValueError, match=r"\[0, 97\)"):
        e.add_request([97], SamplingParams())
    drain(e)
    assert_all_free(e)


def test_kv_exhaustion_fake_runner_preempts_and_recovers():
    r = FakeRunner(12, page_size=4)                   # 48 tokens of KV
    e = make_engine(r, max_num_seqs=16, max_num_batched_tokens=64)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 97, int(rng.integers(4, 12))).tolist() for _ in range(16)]
    for i, p in enumerate(prompts):
        e.add_request(p, SamplingParams(max_tokens=12, **GREEDY), f"r{i}")
    outs = drain(e)
    assert e.metrics.num_preemptions_total > 0
    assert all(outs[f"r{i}"][0] == solo(r, p, 12) for i, p in enumerate(prompts))
    assert_all_free(e)


@pytest.fixture(scope="module")
def tiny_plan(tiny_model):
    d, _ = tiny_model("qwen3")
    _, plan = compile_model(model_dir=str(d))
    return plan, load_weights(plan, Checkpoint(d))


def test_kv_exhaustion_tiny_model_outputs_equal_alone(tiny_plan):
    """16 concurrent requests whose demand is ~4x the KV: all finish, each exactly as alone."""
    plan, weights = tiny_plan
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 320, int(rng.integers(6, 13))).tolist() for _ in range(16)]
    params = SamplingParams(max_tokens=12, **GREEDY)
    alone = make_engine(CPURunner(plan, weights, 8, 4), enable_prefix_caching=False)
    want = []
    for p in prompts:
        alone.add_request(p, params, "x")
        want.append(drain(alone)["x"][0])
    demand = sum(-(-(len(p) + 11) // 4) for p in prompts)
    e = make_engine(CPURunner(plan, weights, demand // 4, 4), max_num_seqs=16)
    start = e.bm.num_free_pages
    for i, p in enumerate(prompts):
        e.add_request(p, params, f"r{i}")
    outs = drain(e)
    assert e.metrics.num_preemptions_total > 0
    assert [outs[f"r{i}"][0] for i in range(16)] == want
    assert e.bm.num_free_pages == start
    assert_all_free(e)


def test_1000_requests_with_random_aborts_leave_nothing_behind():
    r = FakeRunner(40, page_size=4)
    e = make_engine(r, max_num_seqs=24, max_num_batched_tokens=48)
    rng = np.random.default_rng(3)
    stems = [rng.integers(0, 97, 9).tolist() for _ in range(5)]     # shared prefixes: cache hits
    prompts, lengths, live, done, aborted = {}, {}, [], {}, set()
    for i in range(1000):
        rid = f"r{i}"
        prompts[rid] = stems[i % 5][: int(rng.integers(1, 10))] + rng.integers(0, 97, int(rng.integers(0, 4))).tolist()
        lengths[rid] = int(rng.integers(1, 6))
        e.add_request(prompts[rid], SamplingParams(max_tokens=lengths[rid], **GREEDY), rid)
        live.append(rid)
        if rng.random() < 0.1:                       # abort right away, still waiting
            rid = live.pop(int(rng.integers(len(live))))
            assert e.abort(rid) and not e.abort(rid)
            aborted.add(rid)
        if rng.random() < 0.4:
            for o in e.step():
                done.setdefault(o.request_id, []).extend(o.token_ids)
                if o.request_finished:
                    live.remove(o.request_id)
            if live and rng.random() < 0.3:          # abort at a random point of its life
                rid = live.pop(int(rng.integers(len(live))))
                e.abort(rid)
                aborted.add(rid)
            e.bm.check()
    for rid, toks in drain(e).items():
        done.setdefault(rid, []).extend(toks[0])
    assert len(aborted) > 50 and e.metrics.request_success_total["abort"] == len(aborted)
    assert e.bm.hit_tokens > 0
    finished = [rid for rid in prompts if rid not in aborted]
    assert len(finished) + len(aborted) == 1000
    for rid in finished:
        assert done[rid] == solo(r, prompts[rid], lengths[rid]), rid
    assert_all_free(e)


def test_load_counts_the_tokens_left_through_admission_preemption_and_aborts():
    """Scheduler.load (what data-parallel ranks place new requests by), between steps: the
    waiting sequences' uncomputed tokens, kept exactly as they are added, admitted (a cached
    prefix included), preempted back and aborted, plus the running ones' prefill left (not a
    decode's one token); nothing once the engine is idle."""
    r = FakeRunner(10, page_size=4)                   # 40 tokens of KV: preemptions
    e = make_engine(r, max_num_seqs=8, max_num_batched_tokens=12)
    sch = e.scheduler
    rng = np.random.default_rng(7)
    stem = rng.integers(0, 97, 8).tolist()
    waiting = lambda: sum(q.num_uncomputed for q in sch.waiting)  # noqa: E731
    left = lambda: sum(u for q in sch.running if (u := q.num_uncomputed) > 1)  # noqa: E731
    checked = []

    def check():
        assert sch.waiting_tokens == waiting() and sch.load() == waiting() + left()
        checked.append(left())
    for i in range(12):
        prompt = (stem if i % 3 == 0 else []) + rng.integers(0, 97, int(rng.integers(1, 14))).tolist()
        e.add_request(prompt, SamplingParams(max_tokens=int(rng.integers(2, 9)), **GREEDY), f"r{i}")
        assert sch.waiting_tokens == waiting() > 0
        check()
        if i == 5:
            assert e.abort("r4")                         # still waiting: its tokens leave
            check()
        if i % 4 == 3:
            e.step()
            check()
    while e.has_unfinished():
        e.step()
        check()
    assert len(checked) > 10 and any(checked) and sch.num_preemptions > 0 and e.bm.hit_tokens > 0
    assert sch.load() == 0 and sch.waiting_tokens == 0
