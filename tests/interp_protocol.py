"""The interpreted kernels' whole-model protocol, one for every family test that runs a model's
bf16 kernels against the float32 reference executor (tests/test_families_interp.py, and the
family files that follow it): a 21-token prefill (chunks cross the 16-token page), a second
sequence sharing its first page (a prefix hit; computed where the plan keeps per-sequence state,
which no page holds) and computing its 6-token tail, then two batched decode steps, the second as
a wide one where asked (the linears on the GEMMs' tiles, the experts on the grouped GEMMs)."""
import copy

import numpy as np

from infc.runtime.engine.step import Chunk
from infc.runtime.reference.executor import SeqChunk

PAGE = 16


def rel(a, b) -> float:
    """|a - b| / |b| (L2), the difference taken in float64."""
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


def bf16_error(hf, ids, hf_bf16=None) -> float:
    """How far HF's own bf16 forward is from its float32 forward at the last position of ids: the
    noise floor of bf16 for this model (hf_bf16: its bf16 copy, when the caller keeps one)."""
    import torch
    if hf_bf16 is None:
        hf_bf16 = copy.deepcopy(hf).to(torch.bfloat16)
    with torch.no_grad():
        f32 = hf(torch.tensor([ids])).logits[0, -1].numpy()
        bf16 = hf_bf16(torch.tensor([ids])).logits[0, -1].float().numpy()
    return rel(bf16, f32)


def bf16_tolerance(hf):
    """ids -> max(2e-2, 2 x HF's own bf16 error at the last position of ids): each checked
    sequence's bound from its own noise (a prefix-cached sequence's can be 2-3x another's)."""
    import torch
    seen, hf_bf16 = {}, copy.deepcopy(hf).to(torch.bfloat16)

    def tol(ids) -> float:
        key = tuple(ids)
        if key not in seen:
            seen[key] = max(2e-2, 2 * bf16_error(hf, list(ids), hf_bf16))
        return seen[key]
    return tol


def sequences(vocab: int) -> tuple[list, list]:
    """a (21 tokens) and b (a's first page, then 6 more)."""
    rng = np.random.default_rng(3)
    a = [int(t) for t in rng.integers(0, vocab, 21)]
    return a, a[:PAGE] + [int(t) for t in rng.integers(0, vocab, 6)]


def through_kernels(plan, run, ref, a, b, tol, wide=True, check_step=None):
    """The protocol on an InterpExecutor `run` and a ReferenceExecutor `ref` of the same plan: each
    step's logits within `tol` (relative; a number, or ids -> a number: bf16_tolerance, each
    sequence's rows against its own prompt's), and at least half the rows' argmax equal at the
    decode steps. wide: the second decode step runs the wide program (plan["wide_tokens"] lowered to 2).
    check_step(run, step): more checks of a decode step's launches (run.program, run.templates)."""
    bound = tol if callable(tol) else (lambda ids: tol)
    got, want = run.step([Chunk(0, a, 0)]), ref.step([SeqChunk(0, a, 0)])
    assert rel(got, want) < bound(a), ("prefill", rel(got, want))
    if any(c["kind"] == "slot" for c in plan["caches"].values()):
        # per-sequence state (linear attention) is no shared page: the engine never reuses a prefix
        # for such a plan, so the prefix is computed (a chunked prefill)
        run.step([Chunk(1, b[:PAGE], 0)])
    else:
        run.ensure_pages(1, len(b), shared=run.pages[0][:1])
    ref.step([SeqChunk(1, b[:PAGE], 0)])          # the reference has no shared pages: give it the prefix
    got, want = run.step([Chunk(1, b[PAGE:], PAGE)]), ref.step([SeqChunk(1, b[PAGE:], PAGE)])
    assert rel(got, want) < bound(b), ("prefix-cached prefill", rel(got, want))
    toks, lens = [int(np.argmax(want[0]))] * 2, [len(a), len(b)]
    fed = [list(a), list(b)]             # each row's ids so far: its bound is HF's noise there
    for step in range(2):
        if wide and step == 1:
            assert "wide" in plan["programs"] and plan["wide_tokens"] > 2
            plan["wide_tokens"] = 2
        got = run.step([Chunk(0, [toks[0]], lens[0]), Chunk(1, [toks[1]], lens[1])])
        want = ref.step([SeqChunk(0, [toks[0]], lens[0]), SeqChunk(1, [toks[1]], lens[1])])
        if wide:
            assert run.program == ("wide" if step == 1 else "decode")
            if run.program == "wide":
                # the plain linears on the GEMM's decode tiles, the gated ones on the wide GEMV tiles
                assert {t for op, t in run.templates if op == "linear"} == {"gemm"}, run.templates
        if check_step is not None:
            check_step(run, step)
        for row in range(2):
            fed[row].append(toks[row])
            assert rel(got[row], want[row]) < bound(fed[row]), (f"decode {step}, row {row}", rel(got[row], want[row]))
        assert (np.argmax(got, -1) == np.argmax(want, -1)).mean() >= 0.5
        lens = [n + 1 for n in lens]
        toks = [int(t) for t in np.argmax(want, -1)]


def executors(model_dir, out, fuse=True):
    """(plan, InterpExecutor, ReferenceExecutor) of the model saved in model_dir, built into out
    without compiling, its decode steps of 2+ sequences on the decode and wide programs (the narrow
    one, for steps of up to plan narrow_tokens rows, has its own tests: tests/test_interp_models.py,
    tests/test_merge_prologues.py)."""
    import json

    from infc.compiler.build import build
    from infc.compiler.contract.safetensors_io import Checkpoint
    from infc.runtime.reference.executor import ReferenceExecutor
    from infc.runtime.weights.load import load_weights
    from interp_executor import InterpExecutor
    art = build(model_dir=str(model_dir), out=out, compile=False, log=None, page_size=PAGE, fuse=fuse)
    plan = json.loads((art / "plan.json").read_text())
    plan["_dir"] = str(art)
    plan["narrow_tokens"] = min(plan.get("narrow_tokens", 0), 1)
    weights = load_weights(plan, Checkpoint(model_dir))
    return plan, InterpExecutor(plan, weights, page_size=PAGE), ReferenceExecutor(plan, weights)
