"""tests/gpu/test_spec_gpu.py's engine logic on the CPU runner (the tiny qwen3 plan): its prompts,
its two sampling rows (greedy; seeded top-p/top-k with logprobs) and its aborts mid-speculation,
so the GPU call runs a test already seen to work here."""
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

from infc.config import speculative_config
from infc.runtime.engine.engine import Engine
from infc.runtime.engine.runner import CPURunner
from infc.runtime.engine.sampling import SamplingParams
from test_scheduler import tiny_plan  # noqa: F401

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
import test_spec_gpu as gpu  # noqa: E402


def test_the_gpu_tests_engine_logic_on_the_cpu(tiny_plan):  # noqa: F811
    plan, weights = tiny_plan
    rng = np.random.default_rng(43)
    prompts = gpu._prompts(320, 6, rng)
    params = [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, top_k=50, seed=7, ignore_eos=True,
                             logprobs=2)]
    plain = gpu._run(Engine(CPURunner(plan, weights, 128, 16), None, (), 1024, max_num_seqs=8), prompts, params)
    spec = Engine(CPURunner(plan, weights, 128, 16), None, (), 1024, max_num_seqs=8,
                  speculative_config=speculative_config(gpu.SPEC))
    assert gpu._run(spec, prompts, params) == plain
    assert spec.metrics.spec_decode_num_draft_tokens_total > 0
    e = Engine(CPURunner(plan, weights, 128, 16), None, (), 1024, max_num_seqs=8,
               speculative_config=speculative_config(gpu.SPEC))
    free = e.bm.num_free_pages
    gpu._run(e, gpu._prompts(320, 10, rng), params[:1], abort_every=3)
    assert e.bm.num_free_pages == free
    e.bm.check()



def test_the_gpu_draft_model_tests_logic_on_the_cpu(tiny_plan):  # noqa: F811
    """test_spec_gpu.py's draft-model case with CPU runners (the tiny qwen3 drafted by itself):
    its prompts and sampling rows give plain decoding's tokens with every draft accepted, and
    its timing helper runs plain and speculative engines over the two runners."""
    plan, weights = tiny_plan
    target, draft = CPURunner(plan, weights, 128, 16), CPURunner(plan, weights, 128, 16)
    params = [replace(p, max_tokens=6) for p in gpu.DRAFT_PARAMS]
    prompts = gpu.draft_prompts(target.vocab_size)
    plain = gpu.decode_all(Engine(target, None, (), 1024, max_num_seqs=8), prompts, params)
    e = Engine(target, None, (), 1024, max_num_seqs=8, draft_runner=draft,
               speculative_config=speculative_config(gpu.draft_config("self", 3)))
    assert gpu.decode_all(e, prompts, params) == plain
    assert gpu.acceptance(e) == 1.0 and e.metrics.spec_decode_num_draft_tokens_total > 0
    rows = gpu.timings(target, draft, 1024, (0, 2), "self", n=4)
    assert [(k, rate) for k, _, rate in rows] == [(0, None), (2, 1.0)] and all(ms > 0 for _, ms, _ in rows)
