"""Whole tiny models through their generated kernels (interpreted), against the reference.

Each family runs a prefill of two sequences of different lengths, the second sharing the
first one's leading KV pages (a cached prefix), then 4 batched decode steps, with page size 16,
every launch following the plan: its kernel, bindings and grid. The second sequence's 9 new
tokens are a short step (compiler/contract/program.py program_name): its linears run the decode GEMVs."""
import json

import numpy as np
import pytest

from infc.compiler.build import build
from infc.compiler.contract.program import launches
from infc.runtime.reference.executor import ReferenceExecutor, SeqChunk
from infc.compiler.contract.safetensors_io import Checkpoint
from infc.runtime.engine.step import Chunk
from infc.runtime.weights.load import load_weights

from exhaustive import EXHAUSTIVE
from interp_executor import InterpExecutor

# power-of-two head dims (the kernels' tile shapes); hidden sizes that are not
DIMS = dict(hidden_size=96, head_dim=32, intermediate_size=160, num_hidden_layers=2)


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# --no-fuse with --exhaustive: qwen3's and llama's generic kernels are the families' too
# (tests/test_families_interp.py), and the MoE model's unfused route and align launches are each
# checked against their references in tests/kernels/test_moe_kernels.py
@pytest.mark.parametrize("family,fuse", [
    pytest.param(f, fuse, id=f"{f}-{'fused' if fuse else 'no-fuse'}",
                 marks=() if fuse else EXHAUSTIVE)
    for fuse in (True, False) for f in ("qwen3", "llama", "qwen3_moe")])
def test_tiny_model_through_kernels(family, fuse, tiny_model, tmp_path, rng):
    """fuse=False is `infc build --no-fuse`: every op through its generic kernel."""
    d, _ = tiny_model(family, **DIMS)
    # a speculative build: its verify program (verify steps of up to 8 rows: infc/backend.py)
    out = build(model_dir=str(d), out=tmp_path / "art", compile=False, log=None, page_size=16,
                fuse=fuse, narrow_tokens=8)
    plan = json.loads((out / "plan.json").read_text())
    plan["_dir"] = str(out)
    assert plan["short_tokens"] == 64 and "short" in plan["programs"]
    # 37 tokens would be a short step too: a lower threshold keeps the first prefill on the
    # prefill program (the GEMMs) and the 9-token prefix hit on the short one (the GEMVs)
    plan["short_tokens"] = 16
    # the two-sequence decode steps below run the decode and wide programs; the narrow program
    # (one token) and the verify program (steps of up to plan["verify_tokens"] = 8 tokens) run at the end
    verify_tokens, plan["verify_tokens"] = plan.get("verify_tokens"), 1
    weights = load_weights(plan, Checkpoint(d))
    ref = ReferenceExecutor(plan, weights)
    run = InterpExecutor(plan, weights, page_size=16)

    a = [int(t) for t in rng.integers(0, 320, 37)]
    shared = 32                                   # two full pages of a's KV are b's prefix too
    b = a[:shared] + [int(t) for t in rng.integers(0, 320, 9)]
    # sequence 0 prefills; sequence 1 reuses its first two pages and prefills only its tail
    got = run.step([Chunk(0, a, 0)])
    want = ref.step([SeqChunk(0, a, 0)])
    assert run.program == "prefill"
    assert _rel(got, want) < 2e-2
    run.ensure_pages(1, len(b), shared=run.pages[0][:2])
    ref.step([SeqChunk(1, b[:shared], 0)])       # the reference has no paging: give it the prefix
    got = run.step([Chunk(1, b[shared:], shared)])
    want = ref.step([SeqChunk(1, b[shared:], shared)])
    # a mixed step of 9 tokens (T > B = 1): the short program, its linears on the decode GEMVs
    assert run.program == "short"
    linears = {t for op, t in run.templates if op in ("linear", "linear_act_mul", "linear_gated")}
    assert "gemv" in linears and linears <= {"gemv", "gemv_act_mul", "gemv_gated"}, linears
    # attention: the 9-token suffix over the cached prefix takes attention_mixed's split-KV role
    assert "attention_mixed" in {t for _, t in run.templates}
    assert _rel(got, want) < 2e-2
    toks = [int(np.argmax(want[0]))] * 2
    lens = [len(a), len(b)]
    for i in range(4):
        if i == 2:
            # the last two decode steps as wide ones (a step of this many tokens would be): the
            # GEMVs' wide row tiles, the experts through the grouped GEMMs and the router's lists
            assert "wide" in plan["programs"] and plan["wide_tokens"] > 2
            plan["wide_tokens"] = 2
        got = run.step([Chunk(0, [toks[0]], lens[0]), Chunk(1, [toks[1]], lens[1])])
        want = ref.step([SeqChunk(0, [toks[0]], lens[0]), SeqChunk(1, [toks[1]], lens[1])])
        assert run.program == ("wide" if i >= 2 else "decode")
        if run.program == "wide":
            # the plain linears on the GEMM's decode tiles (the gated ones on the wide GEMVs)
            assert {t for op, t in run.templates if op == "linear"} == {"gemm"}, run.templates
        if run.program == "wide" and family == "qwen3_moe":
            experts = {t for op, t in run.templates if op.startswith("moe_")}
            assert {"moe_gate_up_grouped", "moe_down_grouped"} <= experts, experts
        assert _rel(got, want) < 2e-2
        assert (np.argmax(got, -1) == np.argmax(want, -1)).mean() >= 0.5
        lens = [n + 1 for n in lens]
        toks = [int(t) for t in np.argmax(want, -1)]
    # one sequence alone: a narrow step (the residual add + RMSNorm merged into the GEMVs after
    # them; compiler/passes/merge_prologues.py), the decode program's launches without --no-fuse
    got = run.step([Chunk(0, [toks[0]], lens[0])])
    want = ref.step([SeqChunk(0, [toks[0]], lens[0])])
    assert run.program == ("narrow" if fuse else "decode")
    if fuse:
        # q/k RoPE merged into attention, and the attention norm into the qkv GEMV (the MoE
        # layer's second norm, read by the router and the experts, stays a launch:
        # tests/test_merge_prologues.py)
        merged = [l["prologue"]["op"] for l, _ in launches(plan["programs"]["narrow"]) if "prologue" in l]
        assert verify_tokens == 8 and "qk_norm_rope_cache" in merged, run.templates
        ops = {p: [(l["op"], l.get("prologue", {}).get("op")) for l, _ in launches(plan["programs"][p])]
               for p in ("narrow", "verify")}
        assert ops["verify"] == ops["narrow"]        # the same launches (rendered 8 rows wide)
        assert "add_rms_norm" in merged
    assert _rel(got, want) < 2e-2
    assert np.argmax(got, -1) == np.argmax(want, -1)
    if not fuse:
        return
    # a speculative verify step (runtime/engine/speculative/): sequence 0's next token and two
    # drafts as one-token rows, the rows in reverse so each runs before the rows that write the
    # keys it reads (the merged cache write: tests/kernels/test_attention_decode_prologue.py),
    # beside sequence 1's decode row; the verify program (the narrow launches 8 rows wide), its
    # GEMVs' default tensor-core form with 4 live rows (tests/test_verify_program.py: every form
    # against the decode program)
    plan["verify_tokens"] = verify_tokens
    lens[0] += 1
    t0, d0, d1 = int(np.argmax(want[0])), toks[1], toks[0]
    rows = [(0, d1, lens[0] + 2), (1, toks[1], lens[1]), (0, d0, lens[0] + 1), (0, t0, lens[0])]
    got = run.step([Chunk(s, [t], p) for s, t, p in rows])
    # the oracle takes a sequence's tokens in order, one step each: row by row
    w_t0, w_1 = ref.step([SeqChunk(0, [t0], lens[0]), SeqChunk(1, [toks[1]], lens[1])])
    w_d0 = ref.step([SeqChunk(0, [d0], lens[0] + 1)])[0]
    w_d1 = ref.step([SeqChunk(0, [d1], lens[0] + 2)])[0]
    want = np.stack([w_d1, w_1, w_d0, w_t0])
    assert run.program == "verify" and got.shape[0] == 4
    assert _rel(got, want) < 2e-2
