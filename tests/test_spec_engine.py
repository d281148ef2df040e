"""Speculative decoding in the engine (n-gram, runtime/engine/speculative/speculator.py): outputs
identical to non-speculative decoding (greedy and seeded sampling, logprobs, stops, max_tokens
inside an accepted run, n > 1, prefix hits, preemption, aborts), drafts actually accepted, the
step's limits (budget, rows, pages, the batch-size turn-down) kept, every page back after 1,000
aborts, slot-cache plans refused. The fake runner checks the KV it is asked to read was written
(by this step's earlier rows too) and that drafts never write a shared or cached page; the tiny
real model checks the same claim on the reference executor's plan."""
import numpy as np
import pytest

from infc.config import speculative_config
from infc.runtime.engine.engine import Engine
from infc.runtime.engine.runner import CPURunner
from infc.runtime.engine.sampling import SamplingParams
from infc.runtime.engine.step import Chunk, build_step
from exhaustive import EXHAUSTIVE
from test_engine import PROMPT, SCRIPT, FakeTokenizer, G, scripted
from test_scheduler import FakeRunner, assert_all_free, drain, make_engine, solo, tiny_plan  # noqa: F401

GREEDY = dict(temperature=0, ignore_eos=True)


def spec(k=4, lo=1, hi=3, **kw):
    return speculative_config({"method": "ngram", "num_speculative_tokens": k,
                               "prompt_lookup_min": lo, "prompt_lookup_max": hi, **kw})


def periodic(period=7):
    """A fake model that repeats the token `period` back: n-gram drafts are right from then on."""
    return lambda ctx: int(ctx[-period]) if len(ctx) >= period else 3


def outputs(engine, prompts, params):
    """Every request's StepOutputs, by request id (each checked to end once)."""
    for i, p in enumerate(prompts):
        engine.add_request(p, params, f"r{i}")
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault((o.request_id, o.index), []).append(o)
    assert_all_free(engine)
    return outs


def flat(outs):
    """(tokens, text, logprobs, finish_reason, stop_reason) of each sequence's outputs."""
    return {key: ([t for o in os for t in o.token_ids], "".join(o.text for o in os),
                  None if os[0].logprobs is None else [e for o in os for e in o.logprobs],
                  os[-1].finish_reason, os[-1].stop_reason) for key, os in outs.items()}


# -- the fake runner: exact bookkeeping ---------------------------------------------------------
def test_greedy_identity_drafts_accepted_and_fewer_steps():
    r = FakeRunner(64, next_token=periodic())
    prompt = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3]
    e = make_engine(r, speculative_config=spec())
    assert r.can_overlap and not e.overlap          # the proposer reads each last token: synchronous
    e.add_request(prompt, SamplingParams(max_tokens=30, **GREEDY), "a")
    assert drain(e)["a"][0] == solo(r, prompt, 30)
    m = e.metrics
    assert m.spec_decode_num_drafts_total > 0 and m.spec_decode_num_accepted_tokens_total > 20
    assert m.spec_decode_num_accepted_tokens_total <= m.spec_decode_num_draft_tokens_total
    assert m.spec_decode_num_accepted_tokens_per_pos_total[0] >= m.spec_decode_num_accepted_tokens_per_pos_total[3]
    assert len(r.steps) < 12                        # 30 tokens, 5 a step once the drafts land
    assert all(phase == "decode" for phase, _, _ in r.steps[1:])
    assert_all_free(e)


def test_rejected_drafts_roll_back():
    """A model that never repeats itself: drafts are proposed (the prompt repeats) and rejected;
    the output is the model's, and the rejected rows' pages go back every step."""
    r = FakeRunner(64)                              # next token: a hash of the whole context
    prompt = [5, 6, 5, 6, 5, 6, 5, 6]
    e = make_engine(r, speculative_config=spec())
    e.add_request(prompt, SamplingParams(max_tokens=12, **GREEDY), "a")
    seq, got = e.requests["a"].seqs[0], []
    while e.has_unfinished():
        got += [t for o in e.step() for t in o.token_ids]
        if not seq.finished:                        # no page past its computed tokens is kept
            assert len(seq.pages) == e.bm.pages_for(seq.num_computed_tokens), seq
    assert got == solo(r, prompt, 12)
    assert e.metrics.spec_decode_num_draft_tokens_total > e.metrics.spec_decode_num_accepted_tokens_total
    assert_all_free(e)


class ReadsBeforeWrites(FakeRunner):
    """A plan that breaks the claim a verify step rests on: each row sees the KV cache as it was
    before the step (plus its own token), not the keys its step's earlier rows write."""

    def contexts(self, meta):
        before = self.kv_tok.copy()
        out = super().contexts(meta)
        ps = self.page_size
        for b, ctx in enumerate(out):
            p = np.arange(meta.context_lens[b] - 1)
            ctx[:-1] = before[meta.block_tables[b][p // ps] * ps + p % ps]
        return out


def test_a_plan_whose_rows_miss_their_steps_keys_is_caught():
    prompt = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3]
    good = FakeRunner(64, next_token=periodic())
    want = solo(good, prompt, 20)
    r = ReadsBeforeWrites(64, next_token=lambda ctx: int(ctx[-7]) if len(ctx) >= 7 and ctx[-7] >= 0 else 3)
    e = make_engine(r, speculative_config=spec())
    e.add_request(prompt, SamplingParams(max_tokens=20, **GREEDY), "a")
    assert drain(e)["a"][0] != want


COPY = [1, 2, 3, 4] * 3 + [5] + [6, 7, 8, 9] * 4      # "Hello world" x 3, "! and more text?" ...


@pytest.mark.parametrize("params", [
    G(max_tokens=30, stop=["text? and more text"]), G(max_tokens=30, stop=["rldHello wo", "zzz"]),
    G(max_tokens=30, stop_token_ids=[3], min_tokens=4), G(max_tokens=30, stop_token_ids=[9], min_tokens=18),
    G(max_tokens=7, ignore_eos=True), G(max_tokens=23, ignore_eos=True),
    G(max_tokens=30, logprobs=1, stop=["? and more"], include_stop_str_in_output=True),
], ids=["stop-str", "stop-str-2", "stop-id-min-tokens", "stop-id-later", "max-tokens-7", "max-tokens-23",
        "logprobs"])
def test_stops_and_lengths_inside_an_accepted_run(params):
    """COPY repeats itself: from its second token on the drafts are right, so each stop (and
    max_tokens) lands inside an accepted run; what was after it is dropped."""
    want = flat(outputs(scripted(COPY), [PROMPT], params))
    e = scripted(COPY, speculative_config=spec(k=5))
    got = flat(outputs(e, [PROMPT], params))
    assert got == want
    assert e.metrics.spec_decode_num_accepted_tokens_total > 0


def test_context_length_inside_an_accepted_run():
    want = flat(outputs(scripted(COPY, max_model_len=14), [PROMPT], G(max_tokens=None)))
    e = scripted(COPY, max_model_len=14, speculative_config=spec(k=5))
    assert flat(outputs(e, [PROMPT], G(max_tokens=None))) == want
    assert e.metrics.spec_decode_num_accepted_tokens_total > 0


def test_step_limits_rows_budget_and_batch_size_turn_down():
    r = FakeRunner(256, next_token=periodic())
    r.max_seqs = 6                                  # the runner's rows a step (its sequence slots)
    e = make_engine(r, max_num_seqs=5, max_num_batched_tokens=9, speculative_config=spec(k=4))
    prompts = [[i, i + 1, i + 2, i + 3, i + 4, i + 5, i + 6, i] for i in range(1, 40, 8)]
    got = drain_all(e, prompts, 16)
    assert got == [solo(r, p, 16) for p in prompts]
    assert all(len(rows) <= 5 and sum(rows) <= 9 for _, rows, _ in r.steps)
    assert e.metrics.spec_decode_num_accepted_tokens_total > 0
    # over the batch-size threshold: no drafts at all
    r = FakeRunner(256, next_token=periodic())
    e = make_engine(r, speculative_config=spec(k=4, disable_by_batch_size=2))
    assert drain_all(e, prompts[:3], 16) == [solo(r, p, 16) for p in prompts[:3]]
    assert e.metrics.spec_decode_num_drafts_total == 0


def drain_all(e, prompts, n, **kw):
    for i, p in enumerate(prompts):
        e.add_request(p, SamplingParams(max_tokens=n, **GREEDY, **kw), f"r{i}")
    outs = drain(e)
    assert_all_free(e)
    return [outs[f"r{i}"][0] for i in range(len(prompts))]


def test_pages_short_trim_drafts_and_preemption_keeps_outputs():
    r = FakeRunner(14, page_size=4, next_token=periodic(5))   # 56 tokens of KV
    e = make_engine(r, max_num_seqs=8, speculative_config=spec(k=6))
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 97, int(rng.integers(5, 10))).tolist() for _ in range(8)]
    assert drain_all(e, prompts, 14) == [solo(r, p, 14) for p in prompts]
    assert e.metrics.num_preemptions_total > 0 and e.metrics.spec_decode_num_accepted_tokens_total > 0


def test_prefix_hits_with_speculation():
    r = FakeRunner(64, next_token=periodic())
    e = make_engine(r, speculative_config=spec())
    stem = list(range(1, 20))
    for i, tail in enumerate(([1, 2], [3, 4, 5])):
        e.add_request(stem + tail, SamplingParams(max_tokens=20, **GREEDY), f"r{i}")
        assert drain(e)[f"r{i}"][0] == solo(r, stem + tail, 20)
    assert e.bm.hit_tokens > 0 and e.metrics.spec_decode_num_accepted_tokens_total > 0
    assert_all_free(e)


def test_thousand_aborts_mid_speculation_leave_nothing_held():
    r = FakeRunner(40, page_size=4, next_token=periodic(3))
    e = make_engine(r, max_num_seqs=8, speculative_config=spec(k=4, disable_by_batch_size=64))
    abort_storm(e, 0.15, e.bm.check)
    assert e.metrics.spec_decode_num_accepted_tokens_total > 0
    assert_all_free(e)


def abort_storm(e, rate: float, check, aborts: int = 1000):
    """Keep 5 greedy requests of random prompts in flight, aborting each live one with probability
    `rate` after every step (check() after each), until `aborts` were aborted; then the rest."""
    rng = np.random.default_rng(0)
    live, aborted, n = [], 0, 0
    while aborted < aborts:
        while len(live) < 5:
            e.add_request(rng.integers(0, 97, int(rng.integers(3, 9))).tolist(),
                          SamplingParams(max_tokens=int(rng.integers(4, 40)), **GREEDY), f"q{n}")
            live.append(f"q{n}")
            n += 1
        for o in e.step():
            if o.request_finished:
                live.remove(o.request_id)
        for rid in [x for x in live if rng.random() < rate]:
            assert e.abort(rid)
            live.remove(rid)
            aborted += 1
        check()
    for rid in live:
        e.abort(rid)


def test_slot_cache_plans_refuse_speculation():
    r = FakeRunner(16)
    r.num_slots = 4
    r.plan = {"caches": {"conv_state": {"kind": "slot"}, "ssm_state": {"kind": "slot"}, "k": {"kind": "paged"}}}
    with pytest.raises(ValueError, match=r"slot caches \(conv_state, ssm_state\)"):
        Engine(r, speculative_config=spec())


# -- the tiny real model: the reference executor's plan ------------------------------------------
def tiny_engine(tiny_plan, num_pages=64, page_size=16, **kw):
    plan, weights = tiny_plan
    return Engine(CPURunner(plan, weights, num_pages, page_size), max_model_len=1024, **kw)


def copy_prompts(seed, n=3):
    """Random stems repeated: the tiny model's greedy output then falls into copies and loops."""
    rng = np.random.default_rng(seed)
    return [(lambda s: s + s[:int(rng.integers(3, len(s)))])(rng.integers(0, 320, int(rng.integers(6, 14))).tolist())
            for _ in range(n)]


def test_verify_rows_see_the_keys_their_step_writes(tiny_plan):
    """The plan's claim, directly: one step of rows [t], [d0], [d1] of one sequence gives the
    logits three successive decodes give (each row attends to the keys its step's earlier rows
    wrote)."""
    plan, weights = tiny_plan
    prompt = np.random.default_rng(1).integers(0, 320, 11).tolist()
    rows = [(prompt[-1], 10), (17, 11), (250, 12)]
    pages = [3, 0, 5, 1]                             # 16 tokens of 4-token pages, out of order
    step = lambda chunks: build_step(chunks, lambda _: pages, 4)  # noqa: E731

    def prefilled():
        r = CPURunner(plan, weights, 8, 4)
        r.forward(step([Chunk(0, prompt[:-1], 0)]))
        return r
    one = prefilled()
    want = np.concatenate([one.forward(step([Chunk(0, [t], p)])) for t, p in rows])
    meta = step([Chunk(0, [t], p) for t, p in rows])
    assert meta.phase == "decode" and meta.context_lens.tolist() == [11, 12, 13]
    np.testing.assert_allclose(prefilled().forward(meta), want, rtol=1e-4, atol=1e-5)


def test_tiny_model_greedy_identity(tiny_plan):
    prompts = copy_prompts(11, 4)
    params = SamplingParams(max_tokens=24, **GREEDY)
    want = flat(outputs(tiny_engine(tiny_plan), prompts, params))
    e = tiny_engine(tiny_plan, speculative_config=spec(k=4))
    assert flat(outputs(e, prompts, params)) == want
    assert e.metrics.spec_decode_num_accepted_tokens_total > 0


@pytest.fixture(scope="module")
def peaked_plan(tiny_plan):
    """The tiny model with its logits scaled up (final norm x 6): random weights give a nearly
    flat distribution, where sampled drafts would almost never be accepted; peaked, rows accept
    and reject both, so seeded identity is tested on both paths."""
    plan, weights = tiny_plan
    return plan, {**weights, "final_norm": weights["final_norm"] * 6}


SAMPLED = {
    "temperature": dict(temperature=0.8, seed=5),
    "top_p": dict(temperature=0.8, top_p=0.9, seed=6),
    "top_k": dict(temperature=1.0, top_k=8, seed=7),
    "min_p": dict(temperature=0.7, min_p=0.05, seed=8),
    "logprobs": dict(temperature=0.8, top_k=20, top_p=0.95, logprobs=2, seed=9, n=2),
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=[] if n == "logprobs" else EXHAUSTIVE) for n in SAMPLED])
def test_tiny_model_seeded_sampling_identity(peaked_plan, name):
    """Same seed, same text: each row draws with (seed, its output index), as decoding does."""
    prompts = copy_prompts(12, 3)
    params = SamplingParams(max_tokens=24, ignore_eos=True, **SAMPLED[name])
    want = flat(outputs(tiny_engine(peaked_plan), prompts, params))
    e = tiny_engine(peaked_plan, speculative_config=spec(k=3))
    got = flat(outputs(e, prompts, params))
    assert {k: v[0] for k, v in got.items()} == {k: v[0] for k, v in want.items()}
    for k, (_, _, lps, _, _) in got.items():      # each token's logprob is its own row's
        if lps is not None:
            np.testing.assert_allclose([x["logprob"] for x in lps], [x["logprob"] for x in want[k][2]],
                                       rtol=1e-4, atol=1e-4)
            assert [x["token"] for x in lps] == [x["token"] for x in want[k][2]]
    m = e.metrics
    assert 0 < m.spec_decode_num_accepted_tokens_total < m.spec_decode_num_draft_tokens_total


def test_tiny_model_preemption_prefix_hits_and_n(peaked_plan):
    prompts = copy_prompts(13, 5)
    prompts.append(prompts[0][:12] + [1, 2, 3])       # a prefix hit on the first
    params = SamplingParams(max_tokens=16, n=2, seed=3, temperature=0.9, ignore_eos=True)
    want = flat(outputs(tiny_engine(peaked_plan, num_pages=128, page_size=4), prompts, params))
    e = tiny_engine(peaked_plan, num_pages=30, page_size=4, max_num_seqs=8,
                    speculative_config=spec(k=4, disable_by_batch_size=64))
    got = flat(outputs(e, prompts, params))
    assert {k: v[0] for k, v in got.items()} == {k: v[0] for k, v in want.items()}
    assert e.metrics.num_preemptions_total > 0 and e.bm.hit_tokens > 0
    assert e.metrics.spec_decode_num_accepted_tokens_total > 0


def test_stop_strings_with_speculation_real_text():
    """Text deltas of a speculating stream equal the non-speculative stream's, joined."""
    script = COPY
    params = G(max_tokens=30, stop=["? and more text? an"])
    want = flat(outputs(scripted(script), [PROMPT], params))
    e = scripted(script, speculative_config=spec(k=3))
    assert flat(outputs(e, [PROMPT], params)) == want
    assert FakeTokenizer  # the scripted engines' tokenizer


def test_data_parallel_ranks_speculate_each_its_own(tiny_model):
    """Two simulated data-parallel ranks (runtime/reference/ranks.py): each rank's drafts are
    rows of its own step, the steps padded alike; the tokens are the single-rank engine's."""
    from infc.compiler.build import compile_model, compile_ranks
    from infc.compiler.contract.safetensors_io import Checkpoint
    from infc.compiler.parallel import settings
    from infc.runtime.reference.ranks import rank_runner
    from infc.runtime.weights.load import load_weights
    d, _ = tiny_model("qwen3_moe")
    peak = lambda w: {**w, "final_norm": w["final_norm"] * 6}  # noqa: E731 (see peaked_plan)
    _, plan = compile_model(model_dir=str(d))
    plans = [p for _, p in compile_ranks(settings(data_parallel_size=2, enable_expert_parallel=True),
                                         model_dir=str(d))]
    prompts = copy_prompts(14, 4)
    params = SamplingParams(max_tokens=16, temperature=0.5, seed=2, ignore_eos=True)
    one = Engine(CPURunner(plan, peak(load_weights(plan, Checkpoint(d))), 64), max_model_len=256)
    want = flat(outputs(one, prompts, params))
    ranks = rank_runner(plans, [peak(load_weights(p, Checkpoint(d))) for p in plans], 64)
    e = Engine(ranks, max_model_len=256, speculative_config=spec(k=3))
    for i, p in enumerate(prompts):
        e.add_request(p, params, f"r{i}")
    got = {}
    while e.has_unfinished():
        for o in e.step():
            got.setdefault((o.request_id, o.index), []).extend(o.token_ids)
    assert got == {k: v[0] for k, v in want.items()}
    assert all(bm.usage == 0 for bm in e.bms)
    assert e.metrics.spec_decode_num_accepted_tokens_total > 0


def test_rows_that_need_history_decode_plainly_beside_speculating_ones(peaked_plan):
    """Penalties count every token before the one sampled, so a penalized sequence gets no drafts
    (its later rows would need the drafts accepted); in the same steps the others speculate."""
    prompts = copy_prompts(15, 2)
    penalized = SamplingParams(max_tokens=16, temperature=0, repetition_penalty=1.3, ignore_eos=True)
    alone = tiny_engine(peaked_plan, speculative_config=spec(k=3))
    want_pen = flat(outputs(tiny_engine(peaked_plan), prompts[:1], penalized))
    assert flat(outputs(alone, prompts[:1], penalized)) == want_pen
    assert alone.metrics.spec_decode_num_drafts_total == 0
    plain = SamplingParams(max_tokens=16, **GREEDY)
    want = flat(outputs(tiny_engine(peaked_plan), prompts[1:], plain))
    e = tiny_engine(peaked_plan, speculative_config=spec(k=3))
    e.add_request(prompts[0], penalized, "pen")
    e.add_request(prompts[1], plain, "r0")
    got = {}
    while e.has_unfinished():
        for o in e.step():
            got.setdefault(o.request_id, []).extend(o.token_ids)
    assert got["pen"] == want_pen[("r0", 0)][0] and got["r0"] == want[("r0", 0)][0]
    assert e.metrics.spec_decode_num_accepted_tokens_total > 0
    assert_all_free(e)


def test_truncate_gives_back_the_pages_past_the_computed_tokens():
    from infc.runtime.engine.block_manager import BlockManager
    from infc.runtime.engine.sequence import Sequence
    bm = BlockManager(8, 4)
    seq = Sequence(0, "r", 0, list(range(6)), SamplingParams(), 0)
    assert bm.admit(seq, 100) == 6 and len(seq.pages) == 2
    seq.num_computed_tokens = 6
    assert bm.grow(seq, 7) and len(seq.pages) == 4            # 13 tokens: 4 pages
    extra = seq.pages[2:]
    seq.num_computed_tokens = 9                                # 3 of the 7 kept
    bm.truncate(seq)
    assert len(seq.pages) == 3 and bm.num_free_pages == 5
    assert next(iter(bm.free)) == extra[1]                     # handed out first next time
    bm.check()


def test_prompt_logprobs_beside_speculation(peaked_plan):
    """A request scoring its prompt runs in the steps where another verifies drafts (the draft
    rows after the scored chunks): both as without speculation."""
    prompts = copy_prompts(16, 2)
    scored = SamplingParams(max_tokens=6, prompt_logprobs=1, **GREEDY)
    plain = SamplingParams(max_tokens=20, **GREEDY)

    def run(e):
        e.add_request(prompts[0], plain, "a")
        outs = {"a": [o for _ in range(3) for o in e.step()]}   # "a" decodes (and drafts) from here on
        e.add_request(prompts[1], scored, "s")
        while e.has_unfinished():
            for o in e.step():
                outs.setdefault(o.request_id, []).append(o)
        assert_all_free(e)
        return outs
    want, got = run(tiny_engine(peaked_plan)), run(e := tiny_engine(peaked_plan, speculative_config=spec(k=3)))
    for rid in ("a", "s"):
        assert [t for o in got[rid] for t in o.token_ids] == [t for o in want[rid] for t in o.token_ids]
    lp = lambda outs: [None if x is None else x["logprob"] for x in next(o.prompt_logprobs for o in outs if o.prompt_logprobs)]  # noqa: E731
    np.testing.assert_allclose(np.array(lp(got["s"])[1:], float), np.array(lp(want["s"])[1:], float), rtol=1e-4, atol=1e-4)
    assert e.metrics.spec_decode_num_accepted_tokens_total > 0
