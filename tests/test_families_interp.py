"""Every spec family's tiny model (tests/families.py) through its generated Triton kernels,
interpreted (TRITON_INTERPRET=1), against the numpy reference executor, for the fused build and
the `--no-fuse` build (every op through its generic kernel).

As tests/test_interp_models.py: a prefill of one sequence, a second sequence that shares its
first KV page (a cached prefix) and prefills only its tail, then 2 batched decode steps (the
second through the wide program, reading the KV the first wrote), page size 16, every launch following the plan. The prompts (21 and 16 + 6 tokens) are longer than
the families' sliding windows (5-6 tokens) and cross a page boundary, so windowed attention
reads across pages. bf16 kernels against the float32 reference: relative L2 error below
max(2e-2, twice the error HF's own bf16 forward makes against its float32 forward on the same
model and prompt) (gemma3's 4 layers of post-sublayer norms: HF bf16 is 1.4 % off, these
kernels ~2 %), and mostly the same argmax.
"""
import copy
import json

import numpy as np
import pytest

from infc.compiler.build import build
from infc.runtime.reference.executor import ReferenceExecutor, SeqChunk
from infc.compiler.contract.safetensors_io import Checkpoint
from infc.runtime.engine.step import Chunk
from infc.runtime.weights.load import load_weights

from exhaustive import EXHAUSTIVE
from families import FAMILIES, VOCAB
from interp_executor import InterpExecutor

PAGE = 16


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _hf_bf16_error(hf, ids) -> float:
    """How far HF's own bf16 forward is from its float32 forward: the noise floor of bf16."""
    import torch
    with torch.no_grad():
        f32 = hf(torch.tensor([ids])).logits[0, -1].numpy()
        bf16 = copy.deepcopy(hf).to(torch.bfloat16)(torch.tensor([ids])).logits[0, -1].float().numpy()
    return _rel(bf16, f32)


# The `--no-fuse` build in the fast suite: families whose plans together launch every generic
# template any family's does but two (qwen3_5: the linear-attention ones; gpt2: learned positions
# and layer_norm); the two, softcap and affine (gemma2's), are checked against their references
# in tests/kernels/test_generic_kernels.py. The families with their own attention or residual
# shapes (phi: partial rotary and a parallel block; falcon and cohere: parallel blocks) run them in
# their fused builds. The fused builds in the fast suite are a cover of every (program, op,
# attributes but their numbers) launch any family's fused plan makes: gemma's, olmo2's and
# smollm3's launches are all some other family's (measured on tests/families.py's models: they
# add no launch form), so those three run with --exhaustive, as do the other no-fuse builds.
NO_FUSE_FAST = {"qwen3_5", "gpt2"}
FUSED_EXHAUSTIVE = {"gemma", "olmo2", "smollm3"}
CASES = [pytest.param(family, fuse, id=f"{family}-{'fused' if fuse else 'no-fuse'}",
                      marks=() if (family not in FUSED_EXHAUSTIVE if fuse else family in NO_FUSE_FAST)
                      else EXHAUSTIVE)
         for family in FAMILIES for fuse in (True, False)]


@pytest.mark.parametrize("family,fuse", CASES)
def test_family_through_kernels(family, fuse, family_model, tmp_path):
    d, hf = family_model(family)
    out = build(model_dir=str(d), out=tmp_path / "art", compile=False, log=None, page_size=PAGE,
                fuse=fuse)
    plan = json.loads((out / "plan.json").read_text())
    plan["_dir"] = str(out)
    # the decode and wide programs at 2+ sequences: the narrow one (decode steps of up to 8 tokens)
    # has its own tests (tests/test_interp_models.py, tests/test_merge_prologues.py)
    plan["narrow_tokens"] = min(plan.get("narrow_tokens", 0), 1)
    weights = load_weights(plan, Checkpoint(d))
    ref = ReferenceExecutor(plan, weights)
    run = InterpExecutor(plan, weights, page_size=PAGE)

    rng = np.random.default_rng(3)
    a = [int(t) for t in rng.integers(0, VOCAB, 21)]
    b = a[:PAGE] + [int(t) for t in rng.integers(0, VOCAB, 6)]   # shares a's first page
    tol = max(2e-2, 2 * _hf_bf16_error(hf, a))
    got, want = run.step([Chunk(0, a, 0)]), ref.step([SeqChunk(0, a, 0)])
    assert _rel(got, want) < tol, ("prefill", _rel(got, want))
    if any(c["kind"] == "slot" for c in plan["caches"].values()):
        # per-sequence state (qwen3_5's linear attention) is no shared page: the engine never
        # reuses a prefix for such a plan, so the prefix is computed (a chunked prefill)
        run.step([Chunk(1, b[:PAGE], 0)])
    else:
        run.ensure_pages(1, len(b), shared=run.pages[0][:1])
    ref.step([SeqChunk(1, b[:PAGE], 0)])          # the reference has no shared pages: give it the prefix
    got, want = run.step([Chunk(1, b[PAGE:], PAGE)]), ref.step([SeqChunk(1, b[PAGE:], PAGE)])
    assert _rel(got, want) < tol, ("prefix-cached prefill", _rel(got, want))
    toks, lens = [int(np.argmax(want[0]))] * 2, [len(a), len(b)]
    for step in range(2):
        if step == 1:
            # the last decode step as a wide one (a step of that many sequences would be): the
            # plain linears on the GEMM's decode tiles, the gated ones on the wide GEMV tiles
            assert "wide" in plan["programs"] and plan["wide_tokens"] > 2
            plan["wide_tokens"] = 2
        got = run.step([Chunk(0, [toks[0]], lens[0]), Chunk(1, [toks[1]], lens[1])])
        want = ref.step([SeqChunk(0, [toks[0]], lens[0]), SeqChunk(1, [toks[1]], lens[1])])
        assert run.program == ("wide" if step == 1 else "decode")
        if run.program == "wide":
            assert {t for op, t in run.templates if op == "linear"} == {"gemm"}, run.templates
        assert _rel(got, want) < tol, (f"decode {step}", _rel(got, want))
        assert (np.argmax(got, -1) == np.argmax(want, -1)).mean() >= 0.5
        lens = [n + 1 for n in lens]
        toks = [int(t) for t in np.argmax(want, -1)]
