"""specs/deepseek_v2.yaml through its generated Triton kernels under TRITON_INTERPRET=1 (issue 13):
the tiny plain / q_lora checkpoints of tests/test_deepseek_v2.py, fused, against the reference
executor: a 21-token prefill, then 3 decode steps, the last through the wide program (relative error below max(2e-2, twice HF's own
bf16-vs-f32 error on the prompt), as tests/test_families_interp.py bounds the other families)."""
import json

import numpy as np
import pytest

from exhaustive import EXHAUSTIVE

from infc.compiler.build import build
from infc.runtime.reference.executor import ReferenceExecutor, SeqChunk
from infc.compiler.contract.safetensors_io import Checkpoint
from infc.runtime.engine.step import Chunk
from infc.runtime.weights.load import load_weights

from interp_executor import InterpExecutor
from interp_protocol import PAGE, bf16_tolerance, rel as _rel
from test_deepseek_v2 import VARIANTS, VOCAB, models  # noqa: F401  (the module fixture)


@pytest.mark.parametrize("kind", list(VARIANTS))
def test_through_kernels(models, kind, tmp_path):  # noqa: F811
    check_through_kernels(*models[kind], tmp_path)


def check_through_kernels(d, hf, tmp_path, fuse=True):
    """The checkpoint in d (HF's float32 model hf) through its kernels against the reference
    (tests/test_deepseek_v3.py runs it on DeepSeek-V3's router too, tests/test_kimi_k25.py on
    Kimi-K2.5's text model, also --no-fuse)."""
    out = build(model_dir=str(d), out=tmp_path / "art", compile=False, log=None, page_size=PAGE,
                fuse=fuse)
    plan = json.loads((out / "plan.json").read_text())
    plan["_dir"] = str(out)
    weights = load_weights(plan, Checkpoint(d))
    ref, run = ReferenceExecutor(plan, weights), InterpExecutor(plan, weights, page_size=PAGE)
    a = [int(t) for t in np.random.default_rng(3).integers(0, VOCAB, 21)]
    tol = bf16_tolerance(hf)(a)
    got, want = run.step([Chunk(0, a, 0)]), ref.step([SeqChunk(0, a, 0)])
    assert _rel(got, want) < tol, ("prefill", _rel(got, want))
    tok, n = int(np.argmax(want[0])), len(a)
    for step in range(2):      # narrow, then wide (reading the KV the narrow step wrote)
        if step == 1:
            # the last decode step through the wide program (plain linears on the GEMM's decode
            # tiles, the experts on the grouped GEMMs), as a step of that many sequences would
            plan["wide_tokens"], plan["narrow_tokens"] = 1, 0
        got, want = run.step([Chunk(0, [tok], n)]), ref.step([SeqChunk(0, [tok], n)])
        # one sequence's decode step: the narrow program (the dense layer's norms merged into
        # its GEMVs; --no-fuse has none, so the decode program), the wide one when wide_tokens is 1
        assert run.program == ("wide" if step == 1 else "narrow" if fuse else "decode")
        if run.program == "wide":
            assert {t for op, t in run.templates if op == "linear"} == {"gemm"}, run.templates
        assert _rel(got, want) < tol, (f"decode {step}", _rel(got, want))
        tok, n = int(np.argmax(want[0])), n + 1



# the absorbed decode kernel's split protocol: a 40-token context in 16-key tiles over 4 splits
# (3 run; the last to arrive merges), over 2 (two run), over 1 (nothing to merge); the fast suite
# runs 4 (the whole protocol), --exhaustive the other two
@pytest.mark.parametrize("splits", [4, pytest.param(2, marks=EXHAUSTIVE), pytest.param(1, marks=EXHAUSTIVE)])
def test_latent_decode_splits(models, splits, tmp_path):  # noqa: F811
    d, _ = models["plain"]
    out = build(model_dir=str(d), out=tmp_path / "art", compile=False, log=None, page_size=PAGE,
                tuning_overlay={"latent_attention_decode": {"default": {"BLOCK_N": 16, "NUM_SPLITS": splits}}})
    plan = json.loads((out / "plan.json").read_text())
    src = "".join(p.read_text() for p in (out / "kernels").glob("latent_attention_decode_*.py"))
    assert f"min({splits}, max(1, cdiv(" in src
    plan["_dir"] = str(out)
    weights = load_weights(plan, Checkpoint(d))
    ref, run = ReferenceExecutor(plan, weights), InterpExecutor(plan, weights, page_size=PAGE)
    a = [int(t) for t in np.random.default_rng(5).integers(0, VOCAB, 40)]
    run.step([Chunk(0, a, 0)]), ref.step([SeqChunk(0, a, 0)])
    tok, n = 7, len(a)
    for step in range(2):
        got, want = run.step([Chunk(0, [tok], n)]), ref.step([SeqChunk(0, [tok], n)])
        assert _rel(got, want) < 2e-2, (f"decode {step}", _rel(got, want))
        tok, n = int(np.argmax(want[0])), n + 1
