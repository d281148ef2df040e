"""The GPU sampler's logits processing on the device (the logits_process kernel, compiled) against
the numpy reference (runtime/engine/logits_process.py), on a real step's logits at
llama-3.2-1b's vocabulary (128256: no multiple of the kernel's block): mixed rows (penalties,
logit_bias, bans, bitmasks, nothing), the processed logits read back, greedy tokens their argmax,
sampled tokens inside the allowed set, logprobs the raw model's; and what it costs."""
import time

import numpy as np
import pytest

from driver_loop import Pages
from infc.runtime.cuda.runner import CudaRunner
from infc.runtime.engine.logits_process import pack_bitmask, process_logits
from infc.runtime.engine.row_processing import RowProcessing
from infc.runtime.engine.runner import RowSampling
from infc.runtime.engine.sampling import SamplingParams, logprobs_of
from infc.runtime.engine.step import Chunk, build_step
from logits_rows import mixed_rows

MODEL = "llama-3.2-1b"


@pytest.fixture(scope="module")
def runner(model_dir, artifact):
    return CudaRunner(artifact(MODEL), model_dir(MODEL), max_num_batched_tokens=1024, max_num_seqs=32,
                      num_pages=64, buckets=[1, 2, 4, 8, 16, 32])


def step_logits(runner, B):
    rng = np.random.default_rng(41)
    pages = Pages(runner.num_pages, runner.page_size)
    chunks = [Chunk(i, rng.integers(0, runner.vocab_size, 3 + i % 5).tolist(), 0) for i in range(B)]
    for c in chunks:
        pages.ensure(c.seq_id, len(c.tokens))
    meta = build_step(chunks, pages.of.__getitem__, runner.page_size)
    return runner.logits(meta).copy()


def device_logits(runner, B):
    host = np.empty((B, runner.vocab_size), np.float32)
    runner.ctx.dtoh(host, runner.logits_device)
    runner.ctx.sync()
    return host


def test_processed_logits_equal_the_reference(runner):
    V = runner.vocab_size
    rows = mixed_rows(np.random.default_rng(3), V, scale=400)
    for r in rows:
        if r is not None:
            r.params.temperature, r.params.logprobs = 0.0, 1
    logits = step_logits(runner, len(rows))
    runner.ctx.htod(runner.logits_device, logits)      # the raw logits, as the step left them
    got = runner.sampler.sample(runner.logits_device, rows)
    after = device_logits(runner, len(rows))
    for b, r in enumerate(rows):
        want = logits[b] if r is None else process_logits(logits[b], r)
        assert np.array_equal(np.isinf(after[b]), np.isinf(want)), b
        assert np.allclose(after[b], want, rtol=1e-6, atol=1e-5), (b, float(np.abs(after[b] - want).max()))
        if r is not None:
            assert got[b].token == int(np.argmax(want)), b
            assert abs(got[b].logprob - logprobs_of(logits[b])[got[b].token]) < 1e-4, b      # the model's


def test_sampled_tokens_stay_in_the_allowed_set(runner):
    V = runner.vocab_size
    allowed = np.random.default_rng(5).choice(V, 50, replace=False)
    rows = [RowSampling(SamplingParams(temperature=1.0, top_k=20), seed=s, step=0, allowed=pack_bitmask(allowed, V))
            for s in range(8)]
    for _ in range(4):
        runner.ctx.htod(runner.logits_device, step_logits(runner, 8))
        assert {s.token for s in runner.sampler.sample(runner.logits_device, rows)} <= set(allowed.tolist())


def test_cost_of_the_processing(runner):
    """Printed, not asserted: a 32-row greedy step's sampling with each row penalizing 2,000
    tokens and biasing 100, against the same step with none."""
    V, B = runner.vocab_size, 32
    rng = np.random.default_rng(9)
    logits = step_logits(runner, B)
    plain = [RowSampling(SamplingParams(temperature=0.0), 0, 0) for _ in range(B)]
    proc = []
    for _ in range(B):
        p = SamplingParams(temperature=0.0, repetition_penalty=1.1, frequency_penalty=0.2,
                           logit_bias={int(t): 1.0 for t in rng.choice(V, 100, replace=False)})
        rp = RowProcessing.for_request(p, rng.integers(0, V, 2000).tolist(), V, [])
        proc.append(RowSampling(p, 0, 0, penalties=rp.penalties()))
    for name, rows in (("plain", plain), ("processed", proc)):
        runner.ctx.htod(runner.logits_device, logits)
        runner.sampler.sample(runner.logits_device, rows)          # warm (first use allocates)
        t0 = time.perf_counter()
        for _ in range(20):
            runner.sampler.sample(runner.logits_device, rows)
        print(f"logits_process cost: {name} {B}-row greedy sampling {(time.perf_counter() - t0) / 20 * 1e3:.3f} ms")
