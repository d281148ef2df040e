"""The engine: prefix cache and chunked prefill leave greedy outputs unchanged (tiny real model),
stop conditions (stop strings across token boundaries, stop ids, EOS, min/max tokens, context
length), n > 1 with seeds, seeded sampling whatever else runs, logprobs, metrics, and the async
engine (concurrent streams, abort on cancellation, death surfaces as an error, idle loop)."""
import asyncio
import threading
import time

import numpy as np
import pytest

from infc.runtime.engine.async_engine import AsyncEngine, EngineDeadError
from infc.runtime.engine.engine import Engine
from infc.runtime.engine.runner import ComputedAtLaunch, CPURunner
from infc.runtime.engine.sampling import SamplingParams
from infc.runtime.tokenization.tokenizer import Tokenizer
from test_scheduler import FakeRunner, assert_all_free, drain, make_engine, solo, tiny_plan  # noqa: F401

GREEDY = dict(temperature=0, ignore_eos=True)


class Recording(ComputedAtLaunch):
    """A runner wrapper that records each step's phase."""

    def __init__(self, runner):
        self.runner, self.phases = runner, []
        self.num_pages, self.page_size, self.vocab_size = runner.num_pages, runner.page_size, runner.vocab_size

    def execute(self, meta, sampling):
        self.phases.append(meta.phase)
        return self.runner.execute(meta, sampling)


def tiny_engine(tiny_plan, num_pages=64, page_size=16, **kw):
    plan, weights = tiny_plan
    return Engine(Recording(CPURunner(plan, weights, num_pages, page_size)), max_model_len=1024, **kw)


def run_one(engine, prompt, params, rid="x"):
    engine.add_request(prompt, params, rid)
    return drain(engine)[rid]


# -- prefix cache and chunked prefill on a real model ------------------------------------------
def test_prefix_cache_hit_gives_the_cold_output(tiny_plan):
    rng = np.random.default_rng(5)
    stem = rng.integers(0, 320, 40).tolist()
    p1, p2 = stem + [7, 8], stem + [9]
    params = SamplingParams(max_tokens=8, **GREEDY)
    cold = tiny_engine(tiny_plan, enable_prefix_caching=False)
    want1, want2 = run_one(cold, p1, params)[0], run_one(cold, p2, params)[0]
    e = tiny_engine(tiny_plan)
    e.add_request(p1, params, "a")
    outs = []
    while e.has_unfinished():
        outs += e.step()
    assert outs[0].num_cached_tokens == 0 and [t for o in outs for t in o.token_ids] == want1
    e.add_request(p2, params, "b")
    outs = []
    while e.has_unfinished():
        outs += e.step()
    assert outs[0].num_cached_tokens == 32                      # two full 16-token blocks
    assert [t for o in outs for t in o.token_ids] == want2
    assert e.metrics.prefix_cache_hits_total == 32
    assert_all_free(e)


def test_chunked_prefill_and_mixed_steps_match_unchunked(tiny_plan):
    rng = np.random.default_rng(6)
    prompts = [rng.integers(0, 320, n).tolist() for n in (37, 5, 21)]
    params = SamplingParams(max_tokens=6, **GREEDY)
    whole = tiny_engine(tiny_plan, enable_prefix_caching=False)
    want = [run_one(whole, p, params)[0] for p in prompts]
    e = tiny_engine(tiny_plan, page_size=4, max_num_batched_tokens=7, enable_prefix_caching=False)
    for i, p in enumerate(prompts):
        e.add_request(p, params, f"r{i}")
    outs = drain(e)
    assert [outs[f"r{i}"][0] for i in range(3)] == want
    assert "mixed" in e.runner.phases and len(e.runner.phases) > 10
    assert_all_free(e)


# -- stop conditions (scripted fake runner, fake tokenizer) ------------------------------------
PIECES = ["<eos>", "Hel", "lo", " wo", "rld", "!", " and", " more", " text", "?"]


class FakeTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(PIECES[i] for i in ids if not (skip_special_tokens and i == 0))


PROMPT = [5, 5, 5]


def G(**kw):
    return SamplingParams(temperature=0, **kw)


def scripted(script, tokenizer=FakeTokenizer(), eos=(0,), **kw):
    r = FakeRunner(32, vocab_size=len(PIECES), next_token=lambda ctx: script[len(ctx) - len(PROMPT)])
    return make_engine(r, tokenizer=tokenizer, eos_ids=eos, **kw)


def stream(engine, prompt, params):
    engine.add_request(prompt, params, "s")
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert outs[-1].request_finished and sum(o.finished for o in outs) == 1
    assert_all_free(engine)
    return outs


SCRIPT = [1, 2, 3, 4, 5, 6, 7, 8, 9, 6, 7, 8, 9, 6, 7, 8, 9]    # Hello world! and more text? ...


def test_stop_string_across_token_boundaries_is_cut_and_held_back():
    outs = stream(scripted(SCRIPT), PROMPT, G(max_tokens=16, stop=["o wor", "zzz"]))
    text = "".join(o.text for o in outs)
    assert text == "Hell"
    assert [t for o in outs for t in o.token_ids] == [1, 2, 3, 4]  # ids up to the completing one
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == "o wor"
    # while "o wo" could still become the stop string, its characters were not streamed
    assert [o.text for o in outs] == ["", "H", "ell", ""]


def test_stop_string_on_a_later_token_and_earliest_match_wins():
    outs = stream(scripted(SCRIPT), PROMPT, G(max_tokens=16, stop=[" text", "more"]))
    assert "".join(o.text for o in outs) == "Hello world! and "
    assert outs[-1].stop_reason == "more"


def test_stop_token_ids_eos_and_ignore_eos():
    outs = stream(scripted(SCRIPT), PROMPT, G(max_tokens=16, stop_token_ids=[4]))
    assert [t for o in outs for t in o.token_ids] == [1, 2, 3, 4]
    assert "".join(o.text for o in outs) == "Hello wo"                  # the stop token's text is not
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == 4
    eos_script = [1, 2, 0, 5, 6, 7, 8, 9]
    outs = stream(scripted(eos_script), PROMPT, G(max_tokens=6))
    assert [t for o in outs for t in o.token_ids] == [1, 2, 0] and outs[-1].finish_reason == "stop"
    outs = stream(scripted(eos_script), PROMPT, G(max_tokens=6, ignore_eos=True))
    assert [t for o in outs for t in o.token_ids] == eos_script[:6] and outs[-1].finish_reason == "length"


def test_min_tokens_bans_eos_and_stop_ids_and_delays_stop_strings():
    script = [0, 4, 1, 2, 3, 5, 5, 5]
    p = G(max_tokens=8, min_tokens=3, stop_token_ids=[4], stop=["lo"])
    outs = stream(scripted(script), PROMPT, p)
    toks = [t for o in outs for t in o.token_ids]
    # EOS (0) and the stop id (4) are banned for the first 3: the fake runner takes the next id
    assert toks[:2] == [1, 5] and len(toks) >= 3
    assert "".join(o.text for o in outs) == "Hel!Hel" and outs[-1].stop_reason == "lo"


def test_max_tokens_and_max_model_len():
    outs = stream(scripted(SCRIPT), PROMPT, G(max_tokens=5, ignore_eos=True))
    assert len([t for o in outs for t in o.token_ids]) == 5 and outs[-1].finish_reason == "length"
    e = scripted(SCRIPT, max_model_len=9)
    outs = stream(e, PROMPT, G(max_tokens=None))
    assert len([t for o in outs for t in o.token_ids]) == 9 - len(PROMPT)
    assert outs[-1].finish_reason == "length"


def test_prompt_ids_outside_the_vocabulary_are_refused():
    e = scripted(SCRIPT)
    vocab = e.runner.vocab_size
    for bad in ([1, vocab], [-1, 2], [vocab + 5]):
        with pytest.raises(ValueError, match=rf"prompt token ids must be in \[0, {vocab}\)"):
            e.add_request(bad, G(max_tokens=1))
    assert not e.has_unfinished()                     # nothing half-added
    e.add_request([vocab - 1, 0], G(max_tokens=1))    # the edges of the range are ids
    assert e.has_unfinished()


def test_stop_strings_without_a_tokenizer_are_refused():
    with pytest.raises(ValueError, match="tokenizer"):
        scripted(SCRIPT, tokenizer=None).add_request(PROMPT, G(stop=["x"]))


def test_real_tokenizer_multibyte_text_and_stop_string():
    from smollm2_from_gguf import ensure_smollm2
    tok = Tokenizer(ensure_smollm2())
    text = "Größe: 東京タワー is tall 🗼, END of the story"
    script = tok.tk.encode(text, add_special_tokens=False).ids
    r = FakeRunner(32, vocab_size=tok.vocab_size, next_token=lambda ctx: script[len(ctx) - 1])
    e = make_engine(r, tokenizer=tok)
    e.add_request([1], SamplingParams(max_tokens=len(script), stop=[", END"], **GREEDY), "t")
    deltas = []
    while e.has_unfinished():
        deltas += [o.text for o in e.step()]
    assert "".join(deltas) == "Größe: 東京タワー is tall 🗼"
    assert not any("\ufffd" in d for d in deltas)


# -- n > 1, seeds, logprobs ----------------------------------------------------------------------
def test_n_sequences_share_the_prompt_and_follow_seed_plus_index(tiny_plan):
    prompt = np.random.default_rng(7).integers(0, 320, 35).tolist()
    p = SamplingParams(max_tokens=6, temperature=1.0, seed=11, n=3, ignore_eos=True)
    e = tiny_engine(tiny_plan)
    e.add_request(prompt, p, "n")
    outs = []
    while e.has_unfinished():
        outs += e.step()
    got = {i: [t for o in outs if o.index == i for t in o.token_ids] for i in range(3)}
    cached = {o.index: o.num_cached_tokens for o in outs}
    assert cached == {0: 0, 1: 32, 2: 32}                  # siblings reuse the prompt's blocks
    assert sum(o.request_finished for o in outs) == 1 and outs[-1].request_finished
    alone = tiny_engine(tiny_plan, enable_prefix_caching=False)
    for i in range(3):
        one = SamplingParams(max_tokens=6, temperature=1.0, seed=11 + i, ignore_eos=True)
        assert run_one(alone, prompt, one)[0] == got[i]
    assert len({tuple(v) for v in got.values()}) == 3
    unseeded = run_one(e, prompt, SamplingParams(max_tokens=6, n=3, ignore_eos=True), "u")
    assert len({tuple(v) for v in unseeded.values()}) > 1    # each sequence drew its own seed
    assert_all_free(e)


def test_seeded_sampling_is_reproducible_whatever_else_runs(tiny_plan):
    rng = np.random.default_rng(8)
    prompt = rng.integers(0, 320, 12).tolist()
    p = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, top_k=40, seed=3, ignore_eos=True)
    alone = run_one(tiny_engine(tiny_plan), prompt, p)[0]
    e = tiny_engine(tiny_plan, page_size=4, num_pages=24, max_num_batched_tokens=9)
    for i in range(5):                                      # crowded, chunked, preempted
        e.add_request(rng.integers(0, 320, 15).tolist(), SamplingParams(max_tokens=8, ignore_eos=True), f"o{i}")
    e.add_request(prompt, p, "x")
    assert drain(e)["x"][0] == alone


def test_logprobs_and_metrics(tiny_plan):
    e = tiny_engine(tiny_plan)
    prompt = list(range(1, 20))
    e.add_request(prompt, SamplingParams(max_tokens=4, logprobs=2, **GREEDY), "a")
    e.add_request(prompt, SamplingParams(max_tokens=3, **GREEDY), "b")
    outs = []
    while e.has_unfinished():
        outs += e.step()
    a = [o for o in outs if o.request_id == "a"]
    lps = [lp for o in a for lp in o.logprobs]
    assert [lp["token"] for lp in lps] == [t for o in a for t in o.token_ids]
    assert all(len(lp["top"]) == 2 and lp["logprob"] <= 0 for lp in lps)
    assert lps[0]["top"][0][0] == lps[0]["token"]           # greedy takes the top token
    m = e.metrics
    assert (m.prompt_tokens_total, m.generation_tokens_total) == (38, 7)
    assert m.request_success_total == {"length": 2}
    assert m.time_to_first_token_seconds.count == 2 and m.e2e_request_latency_seconds.count == 2
    assert m.inter_token_latency_seconds.count == 5 and m.request_queue_time_seconds.count == 2
    assert (m.num_requests_running, m.num_requests_waiting, m.kv_cache_usage_perc) == (0, 0, 0.0)
    assert a[-1].metrics["ttft"] <= a[-1].metrics["e2e"]


# -- the async engine ----------------------------------------------------------------------------
class DeviceLost(RuntimeError):
    engine_fatal = True           # as CudaError: what a step cannot survive (engine.is_fatal)


class SlowFake(FakeRunner):
    """A fake runner that takes a little time per step, and can be told to fail."""

    def __init__(self, *a, delay=0.002, fail_after=None, **kw):
        super().__init__(*a, **kw)
        self.delay, self.fail_after, self.calls = delay, fail_after, 0

    def execute(self, meta, sampling):
        self.calls += 1
        if self.fail_after is not None and self.calls > self.fail_after:
            raise DeviceLost("device lost")
        time.sleep(self.delay)
        return super().execute(meta, sampling)


def run_async(coro, timeout=20):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def wait_until(cond, timeout=5.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return False


def test_async_concurrent_generators():
    r = SlowFake(64)
    ae = AsyncEngine(make_engine(r, max_num_seqs=8))
    prompts = {f"r{i}": [i + 1, i + 2, i + 3] for i in range(12)}

    async def one(rid):
        toks, finished = [], []
        async for out in ae.generate(prompts[rid], SamplingParams(max_tokens=5, **GREEDY), rid):
            toks += out.token_ids
            finished.append(out.request_finished)
        assert finished[-1] and not any(finished[:-1])
        return toks

    async def main():
        return await asyncio.gather(*[one(rid) for rid in prompts])

    try:
        got = run_async(main())
        assert got == [solo(r, p, 5) for p in prompts.values()]
        assert max(len(rows) for _, rows, _ in r.steps) > 1       # they really were batched
        assert wait_until(lambda: not ae.engine.has_unfinished())
        assert_all_free(ae.engine)
    finally:
        ae.shutdown()


def test_async_cancel_and_early_exit_abort_and_free_pages():
    r = SlowFake(64, delay=0.005)
    ae = AsyncEngine(make_engine(r, max_num_seqs=1))
    long = SamplingParams(max_tokens=200, **GREEDY)

    async def consume(rid, n):
        got = 0
        async for _ in ae.generate([1, 2, 3], long, rid):
            got += 1
            if got == n:
                break                     # the consumer stops iterating

    async def main():
        task = asyncio.create_task(consume("c", 10**9))
        queued = asyncio.create_task(consume("q", 10**9))   # waits: max_num_seqs=1
        await asyncio.sleep(0.1)
        assert ae.engine.bm.num_free_pages < ae.engine.bm.num_pages
        queued.cancel()                   # a disconnect before its first output
        for _ in range(500):
            if "q" not in ae.engine.requests:
                break
            await asyncio.sleep(0.01)
        assert "q" not in ae.engine.requests and "c" in ae.engine.requests
        task.cancel()                     # a client disconnect mid-stream
        for t in (task, queued):
            with pytest.raises(asyncio.CancelledError):
                await t
        await consume("b", 3)
        for _ in range(500):              # freed while this loop still runs
            if not ae.engine.has_unfinished():
                break
            await asyncio.sleep(0.01)
        assert not ae.engine.has_unfinished()
        await ae.abort("nobody")          # unknown ids are fine

    try:
        run_async(main())
        assert wait_until(lambda: not ae.engine.has_unfinished())
        assert ae.engine.metrics.request_success_total == {"abort": 3}
        assert_all_free(ae.engine)
        steps = r.calls
        time.sleep(0.2)
        assert r.calls == steps           # idle: the loop does not step without work
        assert ae.healthy
    finally:
        ae.shutdown()


def test_a_request_opened_on_another_thread_runs_and_one_never_read_is_aborted():
    """AsyncEngine.open from a worker thread (the server's pool): the engine starts the request at
    once, its outputs wait on the loop's queue until read, and the same tokens come as through
    generate; an opened request closed without being read (a reply that never started) is
    aborted, its pages freed."""
    r = SlowFake(64, delay=0.005)
    ae = AsyncEngine(make_engine(r, max_num_seqs=4))
    params = SamplingParams(max_tokens=5, **GREEDY)

    async def main():
        loop = asyncio.get_running_loop()
        read = await asyncio.to_thread(ae.open, [1, 2, 3], params, "read", loop)
        dropped = await asyncio.to_thread(ae.open, [4, 5, 6], SamplingParams(max_tokens=10**6, **GREEDY),
                                          "dropped", loop)
        for _ in range(500):              # both running, outputs queued before anyone reads them
            if "dropped" in ae.engine.requests and read.queue.qsize():
                break
            await asyncio.sleep(0.01)
        assert "dropped" in ae.engine.requests and read.queue.qsize()
        toks = [t async for out in read for t in out.token_ids]
        await asyncio.to_thread(dropped.close)
        dropped.close()                   # idempotent
        once = ae.open([1], params, "twice", loop)
        with pytest.raises(ValueError, match="already in use"):
            ae.open([1], params, "twice", loop)
        once.close()
        return toks

    try:
        assert run_async(main()) == solo(r, [1, 2, 3], 5)
        assert wait_until(lambda: not ae.engine.has_unfinished())
        assert ae.engine.metrics.request_success_total.get("abort", 0) >= 1    # (twice: maybe done)
        assert "dropped" not in ae.engine.requests
        assert_all_free(ae.engine)
    finally:
        ae.shutdown()


def test_async_engine_death_is_an_error_not_a_hang():
    ae = AsyncEngine(make_engine(SlowFake(64, fail_after=3)))

    async def consume(rid):
        async for _ in ae.generate([1, 2], SamplingParams(max_tokens=50, **GREEDY), rid):
            pass

    async def main():
        results = await asyncio.gather(consume("a"), consume("b"), return_exceptions=True)
        assert all(isinstance(x, EngineDeadError) for x in results), results
        with pytest.raises(EngineDeadError, match="device lost"):
            await consume("c")

    try:
        run_async(main(), timeout=10)
        assert not ae.healthy and isinstance(ae.error, RuntimeError)
    finally:
        ae.shutdown()


def test_a_request_is_checked_once_on_its_way_in(monkeypatch):
    """The int conversion and vocabulary check of a long prompt cost ~0.5 ms each at 16k tokens:
    AsyncEngine.generate runs check_request once and the engine thread trusts it; a caller that
    checked already (the server, for every prompt before it replies) says so and nobody checks
    again. A numpy prompt still works through the door, and a bad one still fails there."""
    from infc.runtime.engine.engine import Engine
    r = FakeRunner(64)
    ae = AsyncEngine(make_engine(r, max_num_seqs=2))
    calls = []
    check = Engine.check_request
    monkeypatch.setattr(Engine, "check_request", lambda self, ids, p: (calls.append(len(ids)), check(self, ids, p))[1])
    sp = SamplingParams(max_tokens=3, **GREEDY)

    async def main():
        a = [o async for o in ae.generate(np.array([5, 6, 7], np.int64), sp, "door")]
        b = [o async for o in ae.generate([5, 6, 7], sp, "server", checked=True)]
        with pytest.raises(ValueError, match="must be in"):
            async for _ in ae.generate([5, 500], sp, "bad"):
                pass
        return a, b

    a, b = run_async(main())
    ae.shutdown()
    assert calls == [3, 2]                       # the door's two checks; none for "server"
    assert [t for o in a for t in o.token_ids] == [t for o in b for t in o.token_ids] == solo(r, [5, 6, 7], 3)
    e = make_engine(FakeRunner(64))
    e.add_request(np.array([1, 2]), sp, "plain")                 # Engine alone still checks
    assert calls == [3, 2, 2] and all(type(t) is int for t in e.requests["plain"].prompt_ids)
    for bad in ([1, None], [1, 1 << 70], [[1, 2]]):              # not ids: a ValueError that says so
        with pytest.raises(ValueError, match="must be integers"):
            e.add_request(bad, sp)


def test_async_bad_request_and_shutdown():
    ae = AsyncEngine(make_engine(SlowFake(4)))

    async def main():
        with pytest.raises(ValueError, match="can never fit"):
            async for _ in ae.generate([1] * 10, SamplingParams(max_tokens=100), "big"):
                pass
        out = [o async for o in ae.generate([1], SamplingParams(max_tokens=2, **GREEDY), "ok")]
        assert out[-1].request_finished

    run_async(main())
    ae.shutdown()
    assert not ae._thread.is_alive() and threading.active_count() >= 1
    with pytest.raises(EngineDeadError, match="shut down"):
        run_async(main())
