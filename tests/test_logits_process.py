"""The numpy reference of the logits processing (runtime/engine/logits_process.py) against a
per-token loop written from vLLM's definitions; the bitmask's layout; bad words; the token counts
kept per sequence; and the engine not overlapping a step whose rows need the token before."""
import math

import numpy as np
import pytest

from infc.runtime.engine.bad_words import banned_now
from infc.runtime.engine.logits_process import pack_bitmask, process_logits, unpack_bitmask
from infc.runtime.engine.row_processing import RowProcessing
from infc.runtime.engine.runner import RowSampling
from infc.runtime.engine.sampling import SamplingParams
from test_scheduler import FakeRunner, make_engine


def loop_reference(logits, prompt, output, p: SamplingParams, banned=(), allowed=None):
    """vLLM's sampler, one token at a time: allowed ids, bans, logit_bias, then the repetition
    penalty over prompt + output, frequency and presence over the output."""
    out = []
    for v, x in enumerate(np.asarray(logits, np.float64)):
        if (allowed is not None and v not in allowed) or v in banned:
            out.append(-math.inf)
            continue
        x += (p.logit_bias or {}).get(v, 0.0)
        if v in prompt or v in output:
            x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        c = output.count(v)
        x -= p.frequency_penalty * c + p.presence_penalty * (c > 0)
        out.append(x)
    return np.array(out)


def row_of(prompt, output, p, vocab, banned=()):
    rp = RowProcessing.for_request(p, prompt, vocab, [])
    for t in output if rp else ():
        rp.add(t)
    f = rp.row_fields(prompt + output, len(prompt)) if rp else {"allowed": None, "penalties": None}
    return RowSampling(p, 0, len(output), banned, allowed=f["allowed"], penalties=f["penalties"])


CASES = {
    "repetition": SamplingParams(repetition_penalty=1.8),
    "repetition_below_1": SamplingParams(repetition_penalty=0.5),
    "frequency_presence": SamplingParams(frequency_penalty=1.5, presence_penalty=-0.7),
    "bias": SamplingParams(logit_bias={3: 100.0, 4: -100.0, 60: 2.5}),
    "all": SamplingParams(repetition_penalty=1.3, frequency_penalty=-2, presence_penalty=2,
                          logit_bias={5: -3.0, 9: 7.0}, allowed_token_ids=list(range(0, 70, 2)) + [5, 9]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_reference_equals_the_per_token_loop(name):
    gen = np.random.default_rng(len(name))
    V = 77
    p = CASES[name]
    logits = (gen.standard_normal(V) * 4).astype(np.float32)
    prompt = gen.integers(0, V, 12).tolist()
    output = gen.integers(0, V, 20).tolist() + [5, 5, 9]
    banned = (1, 2)
    got = process_logits(logits, row_of(prompt, output, p, V, banned))
    want = loop_reference(logits, prompt, output, p, banned, p.allowed_token_ids)
    assert np.array_equal(np.isinf(got), np.isinf(want))
    assert np.allclose(got, want, rtol=1e-5, atol=1e-5)
    assert not np.allclose(got, logits)          # the case does something


def test_bitmask_layout():
    V = 70
    m = pack_bitmask([0, 31, 32, 69], V)
    assert m.dtype == np.int32 and m.size == 3
    assert m.view(np.uint32).tolist() == [1 | 1 << 31, 1, 1 << 5]
    assert np.flatnonzero(unpack_bitmask(m, V)).tolist() == [0, 31, 32, 69]


def test_bad_words_ban_the_last_token_after_its_prefix():
    words = [[5], [7, 8, 9], [3, 8]]
    assert banned_now(words, []) == (5,)
    assert banned_now(words, [1, 7, 8]) == (5, 9)
    assert banned_now(words, [7, 3]) == (5, 8)
    assert banned_now(words, [8]) == (5,)
    rp = RowProcessing.for_request(SamplingParams(), [7, 8], 20, words)
    assert rp.row_fields([7, 8], 2)["banned"] == (5,)            # the prompt is no prefix
    assert rp.row_fields([7, 8, 1, 7, 8], 2)["banned"] == (5, 9)


def test_counts_are_kept_incrementally():
    p = SamplingParams(frequency_penalty=1.0)
    rp = RowProcessing.for_request(p, [4, 4, 9], 20, [])
    for t in [9, 1, 1, 1]:
        rp.add(t)
    pen = rp.penalties()
    got = {int(t): (int(c), bool(i)) for t, c, i in zip(pen.ids, pen.counts, pen.in_prompt)}
    assert got == {4: (0, True), 9: (1, True), 1: (3, False)}
    assert RowProcessing.for_request(SamplingParams(), [1], 20, []) is None     # nothing to do
    other = RowProcessing.for_request(p, [4, 4, 9], 20, []).sibling()            # n > 1: its own counts
    other.add(4)
    assert other.penalties().counts.tolist() == [1, 0] and rp.penalties().counts.tolist() == [0, 1, 3]


class CountChecker(FakeRunner):
    """Checks that every penalized row's counts hold all the outputs sampled before it (its own:
    n > 1 siblings count apart)."""

    def sample_contexts(self, meta, contexts, sampling):
        for s in sampling:
            if s is not None and s.penalties is not None:
                assert int(s.penalties.counts.sum()) == s.step, "a row's counts miss a pending token"
        return super().sample_contexts(meta, contexts, sampling)

    # deferred sampling (ComputedAtLaunch.can_defer_sampling): the fake's forward writes the KV
    # and reads the contexts; its sampling comes later
    def forward(self, meta):
        return meta, self.contexts(meta)

    def launch_sampling(self, step, sampling):
        step.samples, step.logits = self.sample_contexts(*step.logits, sampling), None


def test_penalized_rows_sample_after_the_token_before():
    """Overlapped, a penalized row's step is launched without its sampling (as a grammar row's),
    which is issued once the token before is read back and counted."""
    r = CountChecker(64, page_size=4)
    e = make_engine(r, overlap=True)
    assert e.overlap
    deferred = []
    forward = r.launch_forward
    r.launch_forward = lambda meta, feed=(): deferred.append(meta.B) or forward(meta, feed)
    e.add_request([1, 2, 3], SamplingParams(max_tokens=8, temperature=0.5, seed=1, ignore_eos=True, n=2,
                                            presence_penalty=1.0), "pen")
    e.add_request([4, 5], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), "plain")
    tokens = {}
    while e.has_unfinished():
        for o in e.step():
            assert o.error is None, o.error
            tokens[o.request_id] = tokens.get(o.request_id, 0) + len(o.token_ids)
    assert tokens == {"pen": 16, "plain": 8}
    assert len(deferred) >= 6                    # the steps overlapped: not read back first


def test_rank_frames_carry_the_logits_processing(rng):
    """A rank process samples every row as rank 0 does (runtime/distributed/step_channel.py): the
    rows' penalties, logit_bias and bitmasks cross the channel whole."""
    from infc.runtime.distributed import step_channel as ch
    from logits_rows import mixed_rows
    from test_rank_workers import random_meta
    V = 300
    rows = mixed_rows(np.random.default_rng(2), V)
    logits = (rng.standard_normal((len(rows), V)) * 3).astype(np.float32)
    meta = random_meta(rng, len(rows), True)
    _, _, back, _ = ch.launch_of(*ch.decode(ch.encode_launch(meta, 3, rows, [])))
    for b, (r, s) in enumerate(zip(rows, back)):
        assert (r is None) == (s is None)
        if r is not None:
            assert np.array_equal(process_logits(logits[b], r), process_logits(logits[b], s)), b
