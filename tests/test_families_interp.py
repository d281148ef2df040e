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
import pytest

from exhaustive import EXHAUSTIVE
from families import FAMILIES, VOCAB
from interp_protocol import bf16_tolerance, executors, sequences, through_kernels


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
    plan, run, ref = executors(d, tmp_path / "art", fuse)

    a, b = sequences(VOCAB)                 # b shares a's first page
    through_kernels(plan, run, ref, a, b, bf16_tolerance(hf))



@pytest.mark.parametrize("wy,chunk", [(True, 16), (False, 32)], ids=["two-launches-chunk16", "one-launch"])
def test_qwen3_5_delta_rule_forms_through_kernels(wy, chunk, family_model, tmp_path, monkeypatch):
    """infc/config.py DELTA_WY / DELTA_CHUNK (compiler/passes/split_delta_rule.py): the prefill, mixed
    and short programs solve the chunks' WY form in delta_rule_wy's launch before each delta rule,
    which reads it; the decode programs launch no maker of W and U. The default (two launches,
    chunks of 32) runs in the fused family case above; here chunks of 16, and the one-launch form
    (DELTA_WY off), through the same protocol."""
    import infc.config
    from infc.compiler.contract.program import launches
    monkeypatch.setattr(infc.config, "DELTA_WY", wy)
    monkeypatch.setattr(infc.config, "DELTA_CHUNK", chunk)
    d, hf = family_model("qwen3_5")
    plan, run, ref = executors(d, tmp_path / "art", True)
    for phase in plan["programs"]:
        ops = [ln["op"] for ln, _ in launches(plan["programs"][phase])]
        rules = [ln for ln, _ in launches(plan["programs"][phase]) if ln["op"] == "gated_delta_rule"]
        solved = wy and phase in ("prefill", "mixed", "short")
        assert ops.count("delta_rule_wy") == (len(rules) if solved else 0), phase
        wys = [ln for ln, _ in launches(plan["programs"][phase]) if ln["op"] == "delta_rule_wy"]
        assert all(r["inputs"][-2:] == w["outputs"] and w["attrs"]["chunk"] == chunk for r, w in zip(rules, wys))
    a, b = sequences(VOCAB)
    through_kernels(plan, run, ref, a, b, bf16_tolerance(hf))


def test_qwen3_5_narrow_steps_convolve_in_the_qkv_gemv(family_model, tmp_path):
    """compiler/passes/merge_epilogues.py: a one-token narrow step's q|k|v GEMV convolves its
    channels (the conv's launch gone from the narrow program alone), reading the conv cache the
    prefill left and shifting it, step after step, against the reference; then a two-sequence
    decode step (the conv's own launch) reads the cache the narrow steps left."""
    from infc.compiler.contract.program import launches
    from infc.runtime.reference.executor import SeqChunk
    from infc.runtime.engine.step import Chunk
    from interp_protocol import rel
    import numpy as np
    d, hf = family_model("qwen3_5")
    plan, run, ref = executors(d, tmp_path / "art", True)
    narrow = [ln for ln, _ in launches(plan["programs"]["narrow"])]
    merged = [ln for ln in narrow if ln.get("epilogue", {}).get("op") == "causal_conv1d"]
    layers = sum(1 for ln, _ in launches(plan["programs"]["decode"]) if ln["op"] == "causal_conv1d")
    assert layers and len(merged) == layers and all(ln["op"] == "linear" for ln in merged)
    assert not any(ln["op"] == "causal_conv1d" for ln in narrow)
    tol = bf16_tolerance(hf)
    a, b = sequences(VOCAB)
    for s, ids in enumerate((a, b)):
        got, want = run.step([Chunk(s, ids, 0)]), ref.step([SeqChunk(s, ids, 0)])
        assert rel(got, want) < tol(ids)
    fed, lens = [list(a), list(b)], [len(a), len(b)]
    for step in range(4):
        t = int(np.argmax(want[-1] if want.ndim > 1 else want))
        got, want = run.step([Chunk(0, [t], lens[0])]), ref.step([SeqChunk(0, [t], lens[0])])
        assert run.program == "narrow"
        fed[0].append(t)
        lens[0] += 1
        assert rel(got, want) < tol(fed[0]), (step, rel(got, want))
        assert np.argmax(got, -1) == np.argmax(want, -1)
    toks = [int(np.argmax(want[-1] if want.ndim > 1 else want)), fed[1][-1]]
    got = run.step([Chunk(0, [toks[0]], lens[0]), Chunk(1, [toks[1]], lens[1])])
    want = ref.step([SeqChunk(0, [toks[0]], lens[0]), SeqChunk(1, [toks[1]], lens[1])])
    assert run.program == "decode"
    for row in range(2):
        assert rel(got[row], want[row]) < tol(fed[row] + [toks[row]]), row
