"""GpuSampler's logits processing on the fake device (tests/fake_cuda.py: host memory, the
rendered sampler kernels under the Triton interpreter): the rows' penalties, logit_bias, bans
and bitmasks reach the logits_process kernel through the sampler's staging, the processed logits
equal the numpy reference (runtime/engine/logits_process.py), greedy tokens are their argmax,
logprobs stay the raw model's, and a step where no row has processing launches no such kernel."""
import numpy as np

from infc.compiler.codegen.render import render_sampler
from infc.runtime.engine.logits_process import process_logits
from infc.runtime.engine.runner import RowSampling
from infc.runtime.engine.sampling import SamplingParams, logprobs_of
from logits_rows import mixed_rows

V = 300


def sampler(drv, max_seqs=8, edit=None):
    """A GpuSampler over freshly rendered sampler kernels on the fake device; edit: source ->
    source, applied to each kernel first (a kernel as an older renderer wrote it)."""
    from infc.compiler.codegen.render import parse_meta
    from infc.runtime.cuda.artifact import KernelFn
    from infc.runtime.cuda.sampler import GpuSampler
    from infc.runtime.cuda.staging import Staging
    plan = {"buffers": {"logits": {"shape": [max_seqs, V]}}, "outputs": {"logits": "logits"}, "config": {}}
    ctx = drv.Context()
    kernels = {}
    for kid, k in render_sampler(plan, {}).items():
        source = edit(k.source) if edit else k.source
        meta = parse_meta(source, "triton") if edit else k.meta
        kernels[kid] = KernelFn(kid, meta, {"num_warps": meta["num_warps"]},
                                drv.Module(source.encode()).function(meta["entry"]))
    return GpuSampler(ctx, kernels, plan["sampler"], max_seqs, V, staging=Staging(ctx, 1 << 16))


def test_gpu_sampler_applies_the_rows_processing(fake_driver):
    s = sampler(fake_driver)
    gen = np.random.default_rng(7)
    logits = (gen.standard_normal((6, V)) * 3).astype(np.float32)
    rows = mixed_rows(gen, V)
    for r in rows:
        if r is not None:
            r.params.temperature, r.params.logprobs = 0.0, 2
    ptr = s.ctx.alloc(4 * 8 * V)
    s.ctx.htod(ptr, logits)
    out = s.sample(ptr, rows)
    got = s.ctx.view(ptr, logits.size, np.float32).reshape(logits.shape)
    names = [launch.fn.name for launch in fake_driver.launches]
    assert names == ["log_softmax", "logits_process", "sample_argmax"]
    for b, r in enumerate(rows):
        want = logits[b] if r is None else process_logits(logits[b], r)
        assert np.allclose(got[b], want, rtol=1e-6, atol=1e-5) and np.array_equal(np.isinf(got[b]), np.isinf(want))
        if r is not None:
            assert out[b].token == int(np.argmax(want))
            assert abs(out[b].logprob - logprobs_of(logits[b])[out[b].token]) < 1e-4     # the raw model's
    # grown on demand: a step with more entries than the first allocation fits
    big = [RowSampling(SamplingParams(temperature=0, logit_bias={t: -1.0 for t in range(V)}), 0, 0)] * 8
    s.ctx.htod(ptr, np.tile(logits[:1], (8, 1)))
    assert {o.token for o in s.sample(ptr, big)} == {int(np.argmax(logits[0]))}
    # nothing to process: no logits_process launch
    fake_driver.launches.clear()
    s.sample(ptr, [RowSampling(SamplingParams(temperature=0), 0, 0), None])
    assert [launch.fn.name for launch in fake_driver.launches] == ["sample_argmax"]
