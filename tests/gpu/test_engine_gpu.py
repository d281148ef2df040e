"""The engine over the CUDA runner: sampling on the GPU, KV exhaustion with preemption by
recompute, 1,000 requests with random aborts, and LLM(device="cuda").

llama-3.2-1b shapes with random weights (fast to step); the sampler is checked against the
logits the same step copied back."""
import numpy as np
import pytest

from driver_loop import Pages
from infc.runtime.cuda.runner import CudaRunner
from infc.runtime.engine.engine import Engine
from infc.runtime.engine.runner import RowSampling
from infc.runtime.engine.sampling import SamplingParams
from infc.runtime.engine.step import Chunk, build_step

MODEL = "llama-3.2-1b"
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def runner(model_dir, artifact):
    return CudaRunner(artifact(MODEL), model_dir(MODEL), max_num_batched_tokens=4096, max_num_seqs=32,
                      num_pages=256, buckets=[1, 2, 4, 8, 16, 24, 32])


def log_softmax(x):
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def test_gpu_sampler_matches_the_logits(runner):
    rng = np.random.default_rng(5)
    pages = Pages(runner.num_pages, runner.page_size)
    chunks = [Chunk(i, rng.integers(0, runner.vocab_size, int(n)).tolist(), 0) for i, n in enumerate([5, 40, 17, 1, 99, 64])]
    for c in chunks:
        pages.ensure(c.seq_id, len(c.tokens))
    meta = build_step(chunks, pages.of.__getitem__, runner.page_size)
    logits = runner.logits(meta).copy()
    ptr = runner.logits_device
    want = logits.argmax(-1)
    lp = log_softmax(logits)

    def rows(**kw):
        return [RowSampling(SamplingParams(**kw), seed=11 + b, step=3) for b in range(meta.B)]

    greedy = runner.sampler.sample(ptr, rows(temperature=0.0, logprobs=5))
    assert [s.token for s in greedy] == want.tolist()
    for b, s in enumerate(greedy):
        assert abs(s.logprob - lp[b, s.token]) < 1e-4
        top = np.argsort(-lp[b], kind="stable")[:5]
        assert [t for t, _ in s.top] == top.tolist()
        assert np.allclose([v for _, v in s.top], lp[b, top], atol=1e-4)
    # the sample kernel: temperature 1 is reproducible by (seed, step); top_k=1 and min_p=1 are greedy
    a = [s.token for s in runner.sampler.sample(ptr, rows(temperature=1.0))]
    b = [s.token for s in runner.sampler.sample(ptr, rows(temperature=1.0))]
    assert a == b
    draws = {runner.sampler.sample(ptr, [RowSampling(SamplingParams(temperature=1.0), seed=s, step=0)])[0].token
             for s in range(32)}
    assert len(draws) > 8                          # a flat random-weight distribution: many tokens
    assert [s.token for s in runner.sampler.sample(ptr, rows(temperature=1.0, min_p=1.0))] == want.tolist()
    assert [s.token for s in runner.sampler.sample(ptr, rows(temperature=0.7, top_k=1))] == want.tolist()
    k40 = runner.sampler.sample(ptr, rows(temperature=1.0, top_k=40))
    for bi, s in enumerate(k40):
        assert s.token in set(np.argsort(-logits[bi])[:40].tolist())
    # banned tokens (EOS before min_tokens): the best one is masked, the logprob stays the model's
    banned = [RowSampling(SamplingParams(temperature=0.0, logprobs=1), 0, 0, banned=(int(want[b]),))
              for b in range(meta.B)]
    second = np.argsort(-logits, -1, kind="stable")[:, 1]
    got = runner.sampler.sample(ptr, banned)
    assert [s.token for s in got] == second.tolist()
    assert all(abs(s.logprob - lp[b, s.token]) < 1e-4 for b, s in enumerate(got))


def make_engine(runner, **kw):
    kw.setdefault("max_num_seqs", 32)
    kw.setdefault("max_num_batched_tokens", 1024)
    return Engine(runner, None, (), 2048, **kw)


def drain(e):
    out = {}
    while e.has_unfinished():
        for o in e.step():
            out.setdefault(o.request_id, []).extend(o.token_ids)
    return out


def assert_all_free(e, start):
    assert not e.requests and not e.scheduler.running and not e.scheduler.waiting
    assert all(b.ref == 0 for b in e.bm.blocks)
    assert e.bm.num_free_pages == start
    e.bm.check()


def test_kv_exhaustion_all_complete_as_alone(model_dir, artifact):
    """4x more concurrent demand than the KV holds: every request finishes with exactly the tokens
    it gets alone, those follow the model's learned rule (each reads the KV two positions back),
    and the free-page count returns to its start. The tiny trained model (trained_model.py): on
    random weights, near-tied logits flip between valid kernel paths (see its docstring)."""
    from trained_model import follow, prompt
    rng = np.random.default_rng(7)
    out_len, n = 24, 16
    prompts = [prompt(rng, int(rng.integers(40, 160))) for _ in range(n)]
    demand = sum(-(-(len(p) + out_len) // 16) for p in prompts)
    r = CudaRunner(artifact("skipgram"), model_dir("skipgram"), max_num_batched_tokens=1024, max_num_seqs=16,
                   num_pages=demand // 4, buckets=[1, 2, 4, 8, 16])
    params = SamplingParams(max_tokens=out_len, **GREEDY)
    want = []
    for p in prompts:
        alone = make_engine(r, enable_prefix_caching=False)
        alone.add_request(p, params, "x")
        want.append(drain(alone)["x"])
    assert all(w == follow(p, len(p) + out_len)[len(p):] for p, w in zip(prompts, want))
    e = make_engine(r, max_num_seqs=16, max_num_batched_tokens=512)
    start = e.bm.num_free_pages
    for i, p in enumerate(prompts):
        e.add_request(p, params, f"r{i}")
    outs = drain(e)
    print(f"KV exhaustion: {r.num_pages} pages for a demand of {demand}, "
          f"{e.metrics.num_preemptions_total} preemptions")
    assert e.metrics.num_preemptions_total > 0
    assert [outs[f"r{i}"] for i in range(n)] == want
    assert_all_free(e, start)


def test_1000_requests_with_random_aborts(runner):
    e = make_engine(runner, max_num_seqs=32, max_num_batched_tokens=512)
    start = e.bm.num_free_pages
    rng = np.random.default_rng(9)
    # shared prefixes of up to three pages (of the build's size: 16 or 64 tokens), so some prompts
    # hit cached pages
    stem_len = 3 * runner.page_size
    stems = [rng.integers(0, 128000, stem_len).tolist() for _ in range(5)]
    live, aborted, finished = [], set(), set()
    for i in range(1000):
        rid = f"r{i}"
        prompt = stems[i % 5][: int(rng.integers(1, stem_len))] + rng.integers(0, 128000, int(rng.integers(0, 24))).tolist()
        e.add_request(prompt, SamplingParams(max_tokens=int(rng.integers(1, 12)), **GREEDY), rid)
        live.append(rid)
        if rng.random() < 0.1:
            rid = live.pop(int(rng.integers(len(live))))
            assert e.abort(rid)
            aborted.add(rid)
        if rng.random() < 0.5:
            for o in e.step():
                if o.request_finished:
                    live.remove(o.request_id)
                    finished.add(o.request_id)
            if live and rng.random() < 0.3:
                rid = live.pop(int(rng.integers(len(live))))
                e.abort(rid)
                aborted.add(rid)
    for rid in drain(e):
        finished.add(rid)
    assert len(aborted) > 50 and len(finished - aborted) + len(aborted) == 1000
    assert e.metrics.request_success_total["abort"] == len(aborted)
    assert e.bm.hit_tokens > 0
    assert_all_free(e, start)


def test_overlapped_steps_give_the_synchronous_outputs(runner):
    """The engine's overlapped steps (the default: step N + 1 launched before step N's tokens are
    read, its pending tokens copied on the device) against synchronous steps, on the same
    requests: greedy and seeded (top-p) sampling, shared prefixes, chunked prefill."""
    rng = np.random.default_rng(21)
    stem = rng.integers(0, 128000, 40).tolist()
    reqs = []
    for i in range(24):
        prompt = (stem if i % 2 else []) + rng.integers(0, 128000, int(rng.integers(1, 90))).tolist()
        kw = dict(max_tokens=int(rng.integers(2, 20)), **GREEDY)
        if i % 3 == 1:
            kw.update(temperature=0.9, top_p=0.9, seed=100 + i)
        reqs.append((prompt, SamplingParams(**kw)))
    got = {}
    for overlap in (False, True):
        e = make_engine(runner, max_num_seqs=32, max_num_batched_tokens=256, overlap=overlap)
        assert e.overlap == overlap
        for i, (p, sp) in enumerate(reqs):
            e.add_request(p, sp, f"r{i}")
        got[overlap] = drain(e)
    assert got[True] == got[False]
    assert [len(got[True][f"r{i}"]) for i in range(24)] == [sp.max_tokens for _, sp in reqs]


def test_llm_on_cuda(model_dir):
    """LLM(device="cuda") builds (or reuses) its artifact like `infc serve` and generates: on the
    trained model, every continuation follows its rule, and two runs are identical."""
    from infc import LLM
    from trained_model import follow, prompt
    d = model_dir("skipgram")
    llm = LLM(d, device="cuda", kv_cache_tokens=8192, max_num_seqs=8)
    rng = np.random.default_rng(3)
    prompts = [prompt(rng, n) for n in (3, 30, 300)]
    params = SamplingParams(max_tokens=12, **GREEDY)
    a = [o.token_ids for o in llm.generate(prompts, params)]
    b = [o.token_ids for o in llm.generate(prompts, params)]
    assert a == b
    assert all(t == follow(p, len(p) + 12)[len(p):] for p, t in zip(prompts, a))
    assert llm.runner.sampler is not None and not llm.engine.has_unfinished()


def test_wide_decode_steps_follow_the_trained_rules(model_dir, monkeypatch):
    """Decode steps of many sequences run the wide program (the GEMVs' 64- and 128-row tiles): on
    the trained model, 160 prompts decoded together continue by their rules, as they do on the
    decode program (INFC_WIDE=0)."""
    from infc import LLM
    from infc.compiler.contract.program import program_name
    from trained_model import follow, prompt
    d = model_dir("skipgram")
    rng = np.random.default_rng(5)
    prompts = [prompt(rng, int(n)) for n in rng.integers(3, 60, 160)]
    params = SamplingParams(max_tokens=8, **GREEDY)
    outs = {}
    for wide in ("1", "0"):
        monkeypatch.setenv("INFC_WIDE", wide)
        llm = LLM(d, device="cuda", kv_cache_tokens=32768, max_num_seqs=256)
        plan = llm.runner.plan
        assert ("wide" in plan["programs"]) == (wide == "1")
        if wide == "1":
            assert program_name(plan, "decode", len(prompts)) == "wide"
        outs[wide] = [o.token_ids for o in llm.generate(prompts, params)]
        llm.close()
    for got in outs.values():
        assert all(t == follow(p, len(p) + 8)[len(p):] for p, t in zip(prompts, got))
