"""specs/deepseek_v2.yaml through its generated Triton kernels under TRITON_INTERPRET=1 (issue 13):
the tiny plain / q_lora checkpoints of tests/test_deepseek_v2.py, fused, against the reference
executor: a 21-token prefill, then 3 decode steps (relative error below max(2e-2, twice HF's own
bf16-vs-f32 error on the prompt), as tests/test_families_interp.py bounds the other families)."""
import copy
import json

import numpy as np
import pytest
import torch

from infc.compiler.build import build
from infc.runtime.reference.executor import ReferenceExecutor, SeqChunk
from infc.runtime.safetensors_io import Checkpoint
from infc.runtime.step import Chunk
from infc.runtime.weights import load_weights

from interp_executor import InterpExecutor
from test_deepseek_v2 import VARIANTS, VOCAB, models  # noqa: F401  (the module fixture)

PAGE = 16


def _rel(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


@pytest.mark.parametrize("kind", list(VARIANTS))
def test_through_kernels(models, kind, tmp_path):  # noqa: F811
    d, hf = models[kind]
    out = build(model_dir=str(d), out=tmp_path / "art", compile=False, log=None, page_size=PAGE)
    plan = json.loads((out / "plan.json").read_text())
    plan["_dir"] = str(out)
    weights = load_weights(plan, Checkpoint(d))
    ref, run = ReferenceExecutor(plan, weights), InterpExecutor(plan, weights, page_size=PAGE)
    a = [int(t) for t in np.random.default_rng(3).integers(0, VOCAB, 21)]
    with torch.no_grad():
        f32 = hf(torch.tensor([a])).logits[0, -1].numpy()
        bf16 = copy.deepcopy(hf).to(torch.bfloat16)(torch.tensor([a])).logits[0, -1].float().numpy()
    tol = max(2e-2, 2 * _rel(bf16, f32))
    got, want = run.step([Chunk(0, a, 0)]), ref.step([SeqChunk(0, a, 0)])
    assert _rel(got, want) < tol, ("prefill", _rel(got, want))
    tok, n = int(np.argmax(want[0])), len(a)
    for step in range(3):
        got, want = run.step([Chunk(0, [tok], n)]), ref.step([SeqChunk(0, [tok], n)])
        assert _rel(got, want) < tol, (f"decode {step}", _rel(got, want))
        tok, n = int(np.argmax(want[0])), n + 1
