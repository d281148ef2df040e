"""Speculative decoding with a draft model (runtime/engine/speculative/draft_model.py): outputs
identical to plain decoding (greedy and seeded sampling, logprobs, stops inside accepted runs,
n > 1, prefix hits, preemption of the target, evictions in the draft's own short cache, aborts
mid-speculation), a self-draft accepting every draft at any temperature, the draft's KV holding
exactly the true tokens after every rollback, every page of both models back after 1,000 aborts,
a draft of another vocabulary refused; and, for n-gram and draft-model speculation alike, the
engine's sampled output checked against the target's own distribution by a chi-square test.

The fake runners (tests/test_scheduler.py) write each token into the KV slot the step names and
read the context back through the block table, so a draft whose pages or rollback are wrong
proposes from a wrong context: assert_draft_kv reads the draft's cache back after every step."""
import numpy as np
import pytest

from infc.config import speculative_config
from infc.runtime.engine.engine import Engine
from infc.runtime.engine.runner import CPURunner
from infc.runtime.engine.sampling import SamplingParams, filtered_probs
from infc.runtime.engine.step import Chunk, build_step
from exhaustive import EXHAUSTIVE
from test_engine import PIECES, PROMPT, G, scripted
from test_spec_engine import abort_storm
from test_scheduler import FakeRunner, assert_all_free, make_engine, solo, tiny_plan  # noqa: F401
from test_spec_engine import COPY, flat, outputs, spec
from test_spec_verify import chi2_check

GREEDY = dict(temperature=0, ignore_eos=True)


def draft_spec(k=4, **kw):
    return speculative_config({"method": "draft_model", "model": "tiny-draft", "num_speculative_tokens": k, **kw})


def with_draft(target, draft, k=4, spec_kw=None, **kw):
    e = make_engine(target, speculative_config=draft_spec(k, **(spec_kw or {})), draft_runner=draft, **kw)
    if isinstance(draft, FakeRunner):
        draft.bm = e.spec.draft.bm          # the fake asserts it writes only the draft's own pages
    return e


def assert_draft_kv(e, d):
    """Every shadow's KV in the draft's cache is its sequence's true tokens, its pages exactly
    what they hold."""
    seqs = {s.seq_id: s for r in e.requests.values() for s in r.seqs}
    ps, bm = d.page_size, e.spec.draft.bm
    for sid, sh in e.spec.draft.shadows.items():
        seq = seqs[sid]
        n = sh.num_computed_tokens
        assert n <= len(seq.token_ids) and len(sh.pages) == bm.pages_for(n), (sh, seq)
        p = np.arange(n)
        assert d.kv_tok[np.asarray(sh.pages, np.int64)[p // ps] * ps + p % ps].tolist() == seq.token_ids[:n]
    bm.check()


def assert_nothing_held(e):
    assert_all_free(e)
    dp = e.spec.draft
    assert not dp.shadows and not dp.proposed
    assert dp.held_pages() == 0 and all(b.ref == 0 for b in dp.bm.blocks)


def run_checked(e, d, prompts, params):
    for i, p in enumerate(prompts):
        e.add_request(p, params, f"r{i}")
    got = {}
    while e.has_unfinished():
        for o in e.step():
            got.setdefault(o.request_id, {}).setdefault(o.index, []).extend(o.token_ids)
        assert_draft_kv(e, d)
    assert_nothing_held(e)
    return got


def half_right(target: FakeRunner):
    """A draft model right about half the time (where the context's hash is even)."""
    return lambda ctx: target.context_hash(ctx) if target.context_hash(ctx[::-1]) % 2 else 0


# -- the fake runners: exact bookkeeping ---------------------------------------------------------
def test_self_draft_accepts_every_draft_and_keeps_its_kv_true():
    """The target's next token hashes its whole context (an n-gram proposer finds nothing); a
    draft computing the same function is right every time."""
    r, d = FakeRunner(64), FakeRunner(64)
    e = with_draft(r, d)
    prompts = [[5, 6, 7, 8, 9], [1, 2, 3]]
    got = run_checked(e, d, prompts, SamplingParams(max_tokens=30, **GREEDY))
    assert [got[f"r{i}"][0] for i in range(2)] == [solo(r, p, 30) for p in prompts]
    m = e.metrics
    assert m.spec_decode_num_accepted_tokens_total == m.spec_decode_num_draft_tokens_total > 40
    assert len(r.steps) <= 8                       # 30 tokens, 5 a step


def test_wrong_drafts_roll_back_both_caches():
    r = FakeRunner(64)
    d = FakeRunner(64, next_token=half_right(r))
    e = with_draft(r, d, k=3)
    prompts = [[5, 6, 7, 8, 9], [1, 2, 3], [9, 9, 9, 9, 9, 9, 9, 9, 9, 9]]
    got = run_checked(e, d, prompts, SamplingParams(max_tokens=25, **GREEDY))
    assert [got[f"r{i}"][0] for i in range(3)] == [solo(r, p, 25) for p in prompts]
    m = e.metrics
    assert 0 < m.spec_decode_num_accepted_tokens_total < m.spec_decode_num_draft_tokens_total


@pytest.mark.parametrize("params", [
    G(max_tokens=30, stop=["text? and more text"]), G(max_tokens=30, stop_token_ids=[3], min_tokens=4),
    G(max_tokens=23, ignore_eos=True),
    G(max_tokens=30, logprobs=1, stop=["? and more"], include_stop_str_in_output=True),
], ids=["stop-str", "stop-id-min-tokens", "max-tokens", "logprobs"])
def test_stops_and_lengths_inside_an_accepted_run(params):
    """A self-draft of a scripted model: every draft lands, so each stop falls inside a run."""
    want = flat(outputs(scripted(COPY), [PROMPT], params))
    d = FakeRunner(32, vocab_size=len(PIECES), next_token=lambda ctx: COPY[len(ctx) - len(PROMPT)])
    e = scripted(COPY, speculative_config=draft_spec(5), draft_runner=d)
    assert flat(outputs(e, [PROMPT], params)) == want
    assert e.metrics.spec_decode_num_accepted_tokens_total > 0
    assert_nothing_held(e)


def test_preemption_prefix_hits_n_and_a_short_draft_cache():
    """The target short of pages (preemption), the draft's cache shorter still (its shadows
    evicted, drafts trimmed), shared prefixes and n = 2: the outputs are each prompt's alone."""
    r = FakeRunner(24, page_size=4)
    d = FakeRunner(9, page_size=4, next_token=half_right(r))
    e = with_draft(r, d, k=4, max_num_seqs=8, spec_kw={"disable_by_batch_size": 64})
    rng = np.random.default_rng(4)
    stem = rng.integers(0, 97, 9).tolist()
    prompts = [stem + rng.integers(0, 97, int(rng.integers(1, 4))).tolist() for _ in range(5)]
    got = run_checked(e, d, prompts, SamplingParams(max_tokens=12, n=2, **GREEDY))
    want = [solo(r, p, 12) for p in prompts]
    assert [got[f"r{i}"] for i in range(5)] == [{0: w, 1: w} for w in want]
    assert e.metrics.num_preemptions_total > 0 and e.bm.hit_tokens > 0 and e.spec.draft.bm.hit_tokens > 0
    assert 0 < e.metrics.spec_decode_num_accepted_tokens_total


def test_the_drafts_rows_and_token_budget_are_kept():
    """A draft runner of 2 rows a step (a CUDA runner's max_seqs) drafts for 2 of the 4 decoding
    sequences a step; the engine's budget of 8 tokens spreads a 30-token prompt's catch-up in the
    draft over several steps, in which it proposes nothing (the draft's steps logged by the fake)."""
    r, d = FakeRunner(64), FakeRunner(64)
    d.max_seqs = 2
    e = with_draft(r, d, k=3, max_num_batched_tokens=8)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8], list(range(10, 40))]
    got = run_checked(e, d, prompts, SamplingParams(max_tokens=16, **GREEDY))
    assert [got[f"r{i}"][0] for i in range(4)] == [solo(r, p, 16) for p in prompts]
    assert all(len(rows) <= 2 and sum(rows) <= 8 for _, rows, _ in d.steps)
    # the long prompt's catch-up: chunks of the whole budget, proposing nothing, step after step
    assert sum(1 for _, rows, smp in d.steps if rows == [8] and smp == [False]) >= 4
    assert e.metrics.spec_decode_num_accepted_tokens_total == e.metrics.spec_decode_num_draft_tokens_total > 0


def test_thousand_aborts_mid_speculation_leave_nothing_held_in_either_model():
    r = FakeRunner(40, page_size=4)
    d = FakeRunner(30, page_size=4, next_token=half_right(r))
    e = with_draft(r, d, k=3, max_num_seqs=8, spec_kw={"disable_by_batch_size": 64})
    abort_storm(e, 0.3, lambda: (e.bm.check(), e.spec.draft.bm.check()))
    assert e.metrics.spec_decode_num_accepted_tokens_total > 0
    assert_nothing_held(e)


def test_a_draft_of_another_vocabulary_or_none_is_refused():
    with pytest.raises(ValueError, match=r"its vocabulary has 50 tokens and the target's 97: a draft "
                                         r"must share the target's vocabulary"):
        with_draft(FakeRunner(16), FakeRunner(16, vocab_size=50))
    with pytest.raises(ValueError, match=r"'draft_model': no runner of the draft model 'tiny-draft'"):
        make_engine(FakeRunner(16), speculative_config=draft_spec())
    with pytest.raises(ValueError, match=r"method 'ngram' takes no draft model"):
        make_engine(FakeRunner(16), speculative_config=spec(), draft_runner=FakeRunner(16))
    ranks = FakeRunner(16)
    ranks.dp_world = 2
    with pytest.raises(ValueError, match=r"'draft_model' with data-parallel ranks is not supported yet"):
        with_draft(ranks, FakeRunner(16))
    hybrid = FakeRunner(16)
    hybrid.num_slots = 4
    with pytest.raises(ValueError, match=r"draft model: it keeps per-sequence state in slot caches"):
        with_draft(FakeRunner(16), hybrid)


# -- the tiny real model: the reference executor ------------------------------------------------
@pytest.fixture(scope="module")
def models(tiny_plan):  # noqa: F811
    """(plan, the target's weights, a near draft's): the tiny qwen3 with its logits scaled up
    (final norm x 6, so sampled drafts are accepted and rejected both) and the same model with
    noise on every matrix (a draft that agrees with it often, not always)."""
    plan, weights = tiny_plan
    target = {**weights, "final_norm": weights["final_norm"] * 6}
    rng = np.random.default_rng(7)

    def noisy(w):
        return w + (0.3 * w.std() * rng.standard_normal(w.shape)).astype(w.dtype) if w.ndim >= 2 else w
    near = {k: [noisy(x) for x in v] if isinstance(v, list) else noisy(v) for k, v in target.items()}
    return plan, target, near


class LogitsOnDevice:
    """A CPU runner whose logits never reach the host (no `forward`), as the CUDA runner's: the
    draft's q is unknown, so its drafts are verified by exact match of coupled draws."""

    def __init__(self, runner):
        self.runner, self.plan = runner, runner.plan
        self.num_pages, self.page_size, self.vocab_size = runner.num_pages, runner.page_size, runner.vocab_size

    def execute(self, meta, rows):
        return self.runner.execute(meta, rows)


def tiny(plan, weights, num_pages=64, page_size=16, draft=None, k=3, spec_kw=None, coupled=False, **kw):
    d = None if draft is None else CPURunner(plan, draft, num_pages, page_size)
    extra = {} if draft is None else dict(speculative_config=draft_spec(k, **(spec_kw or {})),
                                          draft_runner=LogitsOnDevice(d) if coupled else d)
    return Engine(CPURunner(plan, weights, num_pages, page_size), max_model_len=1024, **extra, **kw)


def copy_prompts(seed, n=3):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 320, int(rng.integers(6, 14))).tolist() for _ in range(n)]


@pytest.mark.parametrize("rule", ["rejection", "coupled"])
def test_tiny_self_draft_accepts_everything_sampled(models, rule):
    """Draft = target, sampled with logprobs: the draft draws with the target's (seed, index)
    randomness, so it draws the target's very tokens: acceptance 1, output plain decoding's. Under
    either rule: rejection sampling (q = p), and the exact match of coupled draws that a runner
    whose logits stay on the device gets (the CUDA runner's), where a draft row sampled at another
    output index than the target row it is checked against would draw another token."""
    plan, target, _ = models
    prompts = copy_prompts(21, 2)
    params = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=3, logprobs=2, ignore_eos=True)
    want = flat(outputs(tiny(plan, target), prompts, params))
    e = tiny(plan, target, draft=target, k=4, coupled=rule == "coupled")
    got = flat(outputs(e, prompts, params))
    assert {k: v[0] for k, v in got.items()} == {k: v[0] for k, v in want.items()}
    for key, (_, _, lps, _, _) in got.items():
        np.testing.assert_allclose([x["logprob"] for x in lps], [x["logprob"] for x in want[key][2]],
                                   rtol=1e-4, atol=1e-4)
    m = e.metrics
    assert m.spec_decode_num_accepted_tokens_total == m.spec_decode_num_draft_tokens_total > 10
    assert_nothing_held(e)


SEEDED = dict(temperature=0.9, top_k=20, seed=11, ignore_eos=True)


@pytest.mark.parametrize("mode", ["greedy", "seeded-coupled", "seeded-rejection"])
def test_tiny_near_draft_identity_preemption_prefix_hits_n_aborts(models, mode):
    """A near draft: drafts accepted and rejected; the target short of pages (preemption), a
    shared prefix, n = 2, and two requests aborted mid-speculation: the others' outputs are plain
    decoding's (greedy, and seeded with coupled draws); with rejection sampling (a different
    draw of the same distribution, which depends on where the drafts fell, so on the schedule)
    those of the same run again. Both models hold nothing at the end."""
    plan, target, near = models
    prompts = copy_prompts(22, 5)
    prompts.append(prompts[0][:10] + [1, 2, 3])        # a prefix hit on the first
    params = SamplingParams(max_tokens=14, n=2, **(GREEDY if mode == "greedy" else SEEDED))
    coupled = mode == "seeded-coupled"
    if mode != "seeded-rejection":
        want = flat(outputs(tiny(plan, target, num_pages=128, page_size=4), prompts, params))
    else:
        want = {k: (v,) for k, v in run_aborting(tiny(plan, target, num_pages=30, page_size=4, draft=near, k=3,
                                                     max_num_seqs=16, spec_kw={"disable_by_batch_size": 64}),
                                                prompts, params).items() if k[0][0] == "r"}
    e = tiny(plan, target, num_pages=30, page_size=4, draft=near, k=3, max_num_seqs=16, coupled=coupled,
             spec_kw={"disable_by_batch_size": 64})
    got = run_aborting(e, prompts, params)
    assert {k: v for k, v in got.items() if k[0][0] == "r"} == {k: v[0] for k, v in want.items()}
    m = e.metrics
    assert m.num_preemptions_total > 0 and e.bm.hit_tokens > 0
    assert 0 < m.spec_decode_num_accepted_tokens_total < m.spec_decode_num_draft_tokens_total
    assert_nothing_held(e)


def run_aborting(e, prompts, params):
    """Two requests admitted first and aborted mid-speculation, then the prompts'."""
    e.add_request([7] * 9, params, "x0")               # admitted first, aborted mid-speculation
    e.add_request([8] * 9, params, "x1")
    for i, p in enumerate(prompts):
        e.add_request(p, params, f"r{i}")
    got, steps = {}, 0
    while e.has_unfinished():
        for o in e.step():
            got.setdefault((o.request_id, o.index), []).extend(o.token_ids)
        steps += 1
        if steps == 4:                                  # both verify drafts by now
            assert all(any(s.seq_id in e.spec.draft.shadows for s in e.requests[r].seqs) for r in ("x0", "x1"))
            assert e.abort("x0") and e.abort("x1")
    return got


# -- the chi-square test: sampled speculative output has the target's distribution ---------------
CHI_PARAMS = dict(temperature=0.9, top_k=4, top_p=0.92, min_p=0.05)


def target_table(plan, weights, prompt, params, depth):
    """{(t_0, .., t_{depth-1}): probability} of the target's first `depth` sampled tokens, from
    its own logits (a fresh prefill of each context) through the sampler's filters."""
    runner = CPURunner(plan, weights, 16, 16)

    def probs(ctx):
        meta = build_step([Chunk(0, list(ctx), 0)], lambda _: list(range(16)), 16)
        return filtered_probs(runner.forward(meta)[0], params)
    table = {(): 1.0}
    for _ in range(depth):
        table = {key + (t,): pr * q for key, pr in table.items()
                 for p in [probs(prompt + list(key))] for t in np.flatnonzero(p) for q in [p[t]]}
    return table


def check_counts(counts: dict, table: dict):
    """test_spec_verify.chi2_check over the table's cells and any drawn outside them."""
    keys = sorted(set(table) | set(counts))
    chi2_check(np.array([counts.get(k, 0) for k in keys]), np.array([table.get(k, 0.0) for k in keys]))


@pytest.mark.parametrize("method", ["ngram", "draft_model", pytest.param("draft_model-coupled", marks=EXHAUSTIVE)])
def test_sampled_speculation_has_the_targets_distribution(models, method):
    """600 seeded samples of the first three tokens (top-k, top-p, min-p and temperature on) of
    an engine whose second step verifies a draft (n-gram: the prompt holds the first token, so a
    draft is proposed; draft model: the near draft), counted against the target's own
    probabilities: p > 1e-4 (test_spec_verify.ALPHA) with these fixed seeds, so the test is
    deterministic. Seen failing: drafts emitted unverified (n-gram and draft model: draws outside
    the target's support), a rejection resampled from p instead of max(p - q, 0) (p = 5e-8)."""
    plan, target, near = models
    prompt = [3, 41, 97, 5, 200, 41, 17, 97, 260, 5]
    params = dict(max_tokens=3, ignore_eos=True, **CHI_PARAMS)
    table = target_table(plan, target, prompt, SamplingParams(**CHI_PARAMS), 3)
    if method == "ngram":
        e = tiny(plan, target, num_pages=512, max_num_seqs=512, max_num_batched_tokens=4096,
                 speculative_config=spec(k=2, lo=1, hi=2, disable_by_batch_size=1 << 20))
    else:                                               # rejection sampling; coupled draws
        e = tiny(plan, target, num_pages=512, draft=near, k=2, max_num_seqs=512, max_num_batched_tokens=4096,
                 spec_kw={"disable_by_batch_size": 1 << 20}, coupled=method.endswith("coupled"))
    counts = {}
    for r in range(4):                                  # 150 at a time: their drafts fit the step's rows
        e.add_request(prompt, SamplingParams(n=150, seed=1000 * r, **params), f"r{r}")
        toks = {}
        while e.has_unfinished():
            for o in e.step():
                toks.setdefault(o.index, []).extend(o.token_ids)
        for t in toks.values():
            counts[tuple(t)] = counts.get(tuple(t), 0) + 1
    m = e.metrics
    assert m.spec_decode_num_drafts_total > 300
    assert 0 < m.spec_decode_num_accepted_tokens_total < m.spec_decode_num_draft_tokens_total
    check_counts(counts, table)


def test_rejection_sampling_accepts_more_than_coupled_draws(models):
    """At temperature 1 with no filter, the tiny model's mass spreads over many tokens, where two
    inverse-CDF draws of one uniform from p and from q part ways (coupled: ~0.2 of the drafts
    accepted, computed from the distributions) while min(1, p / q) keeps ~0.7 (per draft position;
    fewer per draft token, the later positions behind a rejection): where the draft's
    q reaches the host, rejection sampling is what pays."""
    plan, target, near = models
    prompts = copy_prompts(23, 3)
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=5, ignore_eos=True)
    rate = {}
    for coupled in (True, False):
        e = tiny(plan, target, draft=near, k=3, coupled=coupled)
        outputs(e, prompts, params)
        m = e.metrics
        rate[coupled] = m.spec_decode_num_accepted_tokens_total / m.spec_decode_num_draft_tokens_total
        assert_nothing_held(e)
    assert rate[False] > 0.3 and rate[False] > 4 * rate[True], rate


# -- the backend: "model" a directory or a variant name ------------------------------------------
def test_llm_with_a_draft_model_directory(tiny_model, tiny_plan):  # noqa: F811
    """LLM(speculative_config={"method": "draft_model", "model": DIR}): the draft compiled and
    loaded beside the target (here the target itself: every draft accepted), outputs plain
    decoding's; a variant name without --load-format dummy has no weights and is refused before
    the target loads."""
    from infc import LLM
    d, _ = tiny_model("qwen3")                          # tiny_plan's directory
    prompts = [[5, 9, 200, 31, 7, 5, 9], [100, 3, 44]]
    params = SamplingParams(max_tokens=10, temperature=0.7, seed=4, ignore_eos=True)
    plain = flat(outputs(tiny(*tiny_plan), prompts, params))
    lines = []
    llm = LLM(d, device="cpu", kv_cache_tokens=512, log=lines.append,
              speculative_config={"method": "draft_model", "model": str(d), "num_speculative_tokens": 3})
    assert any(f"speculative decoding: draft_model, 3 draft tokens (draft {d}: 32 pages x 16 tokens of its own)"
               in line for line in lines), lines
    assert [o.token_ids for o in llm.generate(prompts, params)] == [plain[(f"r{i}", 0)][0] for i in range(2)]
    m = llm.engine.metrics
    assert m.spec_decode_num_accepted_tokens_total == m.spec_decode_num_draft_tokens_total > 0
    assert llm.engine.spec.draft.runner.num_pages == llm.runner.num_pages
    with pytest.raises(ValueError, match=r"draft model 'qwen3-0.6b' is not a model directory; a variant "
                                         r"name has no weights \(random ones need --load-format dummy\)"):
        LLM(d, device="cpu", kv_cache_tokens=512,
            speculative_config={"method": "draft_model", "model": "qwen3-0.6b", "num_speculative_tokens": 3})


def test_a_draft_tokenizer_of_other_ids_is_refused(tmp_path):
    from tokenizers import Tokenizer, models
    from infc.backend import _same_tokenizer
    dirs = []
    vocabs = {"a": {"x": 0, "y": 1, "z": 2}, "b": {"x": 0, "z": 1, "y": 2}, "c": {"x": 0, "y": 1, "z": 2}}
    for name, vocab in vocabs.items():
        (tmp_path / name).mkdir()
        Tokenizer(models.WordLevel(vocab, unk_token="x")).save(str(tmp_path / name / "tokenizer.json"))
        dirs.append(tmp_path / name)
    _same_tokenizer("draft", dirs[0], dirs[2])
    with pytest.raises(ValueError, match=r"draft: its tokenizer's vocabulary is not the target's \(3 and 3 tokens"):
        _same_tokenizer("draft", dirs[0], dirs[1])
