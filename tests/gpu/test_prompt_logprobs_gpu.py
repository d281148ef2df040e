"""Prompt logprobs on the GPU: the CUDA runner re-launches the plan's logits tail at the prompt
rows (compiler/passes/row_logits.py) and scores them in the step that computed them; the result
equals the old path's, one forced-token request per prompt position (tests/prompt_scoring.py),
over a chunked prefill (16-token steps), with and without overlapped steps. (The reference bans
all but one id per request, V - 1 ids each, which the GPU sampler sets to -inf one memset each:
about half a second a position, so the prompts stay short.)

llama-3.2-1b shapes with random weights; bf16 kernels compute a row batched otherwise in each
path, so logprobs agree to 0.05 and near-tied top ids may swap."""
import sys
from pathlib import Path

import numpy as np
import pytest

from infc.runtime.cuda.runner import CudaRunner
from infc.runtime.engine.engine import Engine

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from prompt_scoring import assert_same, engine_scores, forced_reference  # noqa: E402

MODEL = "llama-3.2-1b"


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_gpu_prompt_logprobs_equal_forced_tokens(model_dir, artifact, overlap):
    def engine():
        r = CudaRunner(artifact(MODEL), model_dir(MODEL), max_num_batched_tokens=16, max_num_seqs=32,
                       num_pages=512, buckets=[1, 2, 4, 8, 16, 32])
        return Engine(r, max_model_len=1024, max_num_seqs=32, max_num_batched_tokens=16, overlap=overlap)
    rng = np.random.default_rng(41)
    e = engine()
    assert e.scores_prompts
    V = e.runner.vocab_size
    prompts = [rng.integers(0, V, 24).tolist(), rng.integers(0, V, 9).tolist()]
    want = forced_reference(e, prompts, 5)
    got, _ = engine_scores(e, prompts, 5)
    for g, w in zip(got, want):
        assert_same(g, w, 0.05, exact_order=False)
    e.runner.close()
