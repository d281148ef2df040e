"""Where a step's sampled token ids reach the host (runtime/cuda/sampler.py), on the fake device
(tests/fake_cuda.py, the rendered sampler kernels under Triton's interpreter): the sampler
kernels write them into mapped host memory, one buffer per step parity, with no copy on the
stream (a copy would queue on a copy engine behind the KV tier's saves); INFC_SAMPLED_TOKENS_COPY=1
and an artifact rendered before the kernels' host output copy them, with the same tokens."""
import re

import numpy as np

from infc.runtime.engine.runner import RowSampling
from infc.runtime.engine.sampling import SamplingParams
from test_cuda_logits_process import V, sampler as make_sampler

MAX_SEQS = 4


def without_host_output(source: str) -> str:
    """A sampler kernel as rendered before the host output (no token_host parameter)."""
    source = re.sub(r',\s*\["token_host", "\*i32", "out:1"\]', "", source)
    return source.replace(", token_host", "").replace("token_host +", "token_ptr +")


def sampler(drv, old_kernels=False):
    """A GpuSampler over freshly rendered sampler kernels; old_kernels: as rendered before the
    host output."""
    s = make_sampler(drv, MAX_SEQS, edit=without_host_output if old_kernels else None)
    assert all("token_host" not in [p[0] for p in k.meta["params"]] for k in s.k.values()) == old_kernels
    return s


def rows(temperature):
    return [RowSampling(SamplingParams(temperature=temperature, top_k=20), seed=5 + b, step=0) for b in range(3)]


def two_steps(s, logits):
    """Greedy then seeded sampling, each a started step read once started (as the runner's
    collect does after the step's end event): the tokens and the copies each step issued."""
    ptr = s.ctx.alloc(4 * MAX_SEQS * V)
    s.ctx.htod(ptr, logits)
    out, copies = [], []
    for temperature in (0.0, 1.0):
        before = s.ctx.num_copies
        pending = s.start(ptr, rows(temperature))
        after = s.ctx.num_copies
        out.append([x.token for x in s.finish(pending)])
        copies.append(after - before)         # the seeded step's parameter uploads count too
    return out, copies


def test_the_sampled_ids_are_written_to_mapped_host_memory(fake_driver):
    gen = np.random.default_rng(3)
    logits = (gen.standard_normal((3, V)) * 3).astype(np.float32)
    s = sampler(fake_driver)
    assert s.token_writes
    got, copies = two_steps(s, logits)
    assert got[0] == [int(np.argmax(r)) for r in logits]
    assert s.tokens_dev == [s.ctx.device_ptr(t) for t in s.tokens_host]
    copying = sampler(fake_driver)
    copying.token_writes = False
    want, want_copies = two_steps(copying, logits)
    assert got == want                                   # the same tokens, greedy and seeded
    # one device-to-host copy fewer a step: the ids' (the seeded step also uploads parameters)
    assert [c + 1 for c in copies] == want_copies


def test_the_copy_switch_and_old_kernels_copy(fake_driver, monkeypatch):
    gen = np.random.default_rng(4)
    logits = (gen.standard_normal((3, V)) * 3).astype(np.float32)
    want, _ = two_steps(sampler(fake_driver), logits)
    monkeypatch.setenv("INFC_SAMPLED_TOKENS_COPY", "1")
    s = sampler(fake_driver)
    assert not s.token_writes
    assert two_steps(s, logits)[0] == want
    monkeypatch.delenv("INFC_SAMPLED_TOKENS_COPY")
    old = sampler(fake_driver, old_kernels=True)
    assert not old.token_writes and old.tokens_dev == [None, None]
    assert two_steps(old, logits)[0] == want
