"""A speculative build's verify program (issue 43; compiler/passes/select_kernels.py SAME_LAUNCHES):
the narrow launches rendered k + 1 rows wide beside a one-row narrow program whose kernels are
a one-token build's; the verify rows run the CUDA-core path together (one W pass for the k + 1 rows).
The plan's shape of it, the dispatch (compiler/contract/program.py program_name) and the graph
buckets, a verify step through the interpreted kernels, and greedy speculation over it."""
import json
from pathlib import Path

import numpy as np
import pytest

from infc.compiler.build import build, compile_model
from infc.compiler.codegen.render import render_plan
from infc.compiler.contract.program import launches, program_name
from infc.runtime.engine.step import Chunk

from exhaustive import EXHAUSTIVE

K = 4                                           # drafts: the verify program is K + 1 = 5 rows wide
DIMS = dict(hidden_size=96, head_dim=32, intermediate_size=160, num_hidden_layers=2)   # the interpreted case's


@pytest.fixture(scope="module")
def plans(tiny_model):
    d, _ = tiny_model("qwen3")                  # the suite's shared tiny model
    _, one = compile_model(model_dir=str(d))
    _, spec = compile_model(model_dir=str(d), narrow_tokens=K + 1)
    return d, one, spec


def _ids(plan, program):
    return [l["kernel_id"] for l, _ in launches(plan["programs"][program])]


def test_the_speculative_plan_is_the_one_token_plan_and_a_verify_program(plans):
    _, one, spec = plans
    assert "verify" not in one["programs"] and "verify_tokens" not in one
    assert spec["narrow_tokens"] == 1 and spec["verify_tokens"] == K + 1
    # the verify program's launches are the narrow ones (the same merges); nothing else moves
    assert spec["programs"]["verify"] == spec["programs"]["narrow"]
    assert {p: v for p, v in spec["programs"].items() if p != "verify"} == one["programs"]
    assert {k: v for k, v in spec.items() if k not in ("programs", "verify_tokens")} == \
        {k: v for k, v in one.items() if k != "programs"}
    k_one, k_spec = render_plan(one, {}, 16), render_plan(spec, {}, 16)
    # every program but verify runs the one-token build's kernels (ids are source digests)
    for p in one["programs"]:
        assert _ids(spec, p) == _ids(one, p), p
    # the verify program's own: its merged GEMVs (k + 1 rows on the tensor-core path by default:
    # gemv.py.j2 VERIFY_DOT) and attention; its lm_head_last is the decode program's kernel
    assert k_one.keys() <= k_spec.keys()
    assert {k_spec[i].template for i in k_spec.keys() - k_one.keys()} == {"gemv", "gemv_gated", "attention_decode"}
    assert k_spec.keys() - k_one.keys() <= set(_ids(spec, "verify")) - set(_ids(spec, "narrow"))
    verify = {l["op"]: k_spec[l["kernel_id"]].source for l, _ in launches(spec["programs"]["verify"])}
    narrow = {l["op"]: k_spec[l["kernel_id"]].source for l, _ in launches(spec["programs"]["narrow"])}
    decode = {l["op"]: k_spec[l["kernel_id"]].source for l, _ in launches(spec["programs"]["decode"])}
    for op in ("linear", "linear_gated"):
        assert "tl.dot(" in verify[op] and "tl.dot(" not in narrow[op], op
        assert "tl.sum(tl.reshape(wf * a4" not in verify[op], op      # no CUDA-core rows ("lanes")
    assert verify["lm_head_last"] == decode["lm_head_last"]
    assert "a verify step: the K/V" in verify["attention_cached"]
    assert "a verify step: the K/V" not in narrow["attention_cached"]


def test_dispatch_and_graph_buckets(plans, fake_driver, monkeypatch):
    _, one, spec = plans
    assert [program_name(spec, "decode", T) for T in range(1, K + 4)] == \
        ["narrow"] + ["verify"] * K + ["decode"] * 2
    assert [program_name(one, "decode", T) for T in (1, 2, K + 1)] == ["narrow", "decode", "decode"]
    assert program_name(spec, "mixed", 3) == "short" and program_name(spec, "prefill", 2) == "short"
    from infc.runtime.cuda import runner as runner_mod
    # a verify step of K + 1 rows gets a bucket of its own width (else padded to 8: decode)
    assert runner_mod.default_buckets(16, spec) == [1, 2, 4, 5, 8, 16]
    assert runner_mod.default_buckets(16, one) == [1, 2, 4, 8, 16]
    assert runner_mod.default_buckets(4, spec) == [1, 2, 4]      # never past max_num_seqs
    # each captured bucket runs the program its steps would
    from test_program import captured_programs
    ran = [name for name, _ in captured_programs(fake_driver, spec, runner_mod.default_buckets(16, spec))]
    assert ran[::2] == ["narrow", "verify", "verify", "verify", "decode", "decode"]     # 1 2 4 5 8 16
    # INFC_NARROW=0 (A/B timing) runs verify steps on the decode program too
    monkeypatch.setenv("INFC_NARROW", "0")
    assert set(runner_mod.ab_programs(spec)["programs"]) == set(spec["programs"]) - {"narrow", "verify"}


def test_a_gemv_launches_the_programs_of_the_path_its_rows_take(plans):
    """A GEMV with both paths under tune GRID "paths" launches as many column programs as the path
    the step's rows take has blocks: one row the CUDA-core path's cdiv(N, BLOCK_N), the verify
    step's k + 1 rows the tensor-core path's cdiv(N, BLOCK_N_DOT); GRID "max" (the default) the
    wider count for both (the extra programs only exit, but each is dispatched)."""
    import copy
    from infc.compiler.contract.bind import grid
    from infc.compiler.tuning_table import load_tuning
    _, _, spec = plans
    seen = 0
    for form in ("paths", "max"):
        plan = copy.deepcopy(spec)
        overlay = {t: {"default": {"FMA_T": 1, "BLOCK_N": 4, "BLOCK_N_DOT": 16, "GRID": form}}
                   for t in ("gemv", "gemv_gated")}
        kernels = render_plan(plan, load_tuning("h200", overlay), 16)
        for launch, _ in launches(plan["programs"]["verify"]):
            if launch["kernel"] not in ("gemv", "gemv_gated") or launch["op"] == "lm_head_last":
                continue
            w = plan["weights"][launch["inputs"][-1]]["shape"]
            cols = w[0]                                  # a gated W's rows: gate and up, interleaved
            meta = kernels[launch["kernel_id"]].meta
            one, rows = (grid(meta, {"T": t, "B": t})[1] for t in (1, K + 1))
            assert one == -(-cols // 4), (form, launch["op"], meta["grid"])
            assert rows == (-(-cols // 16) if form == "paths" else one), (form, launch["op"], meta["grid"])
            seen += 1
    assert seen >= 8


# the verify GEMVs' forms: the default (the tensor-core path: gemv.py.j2 VERIFY_DOT), their rows on
# the CUDA-core path together ("lanes": FMA_T "rows"), and the tensor-core path with each row pass
# of its merged norm
VERIFY_FORMS = {"default": None,
                "lanes": {t: {"default": {"FMA_T": "rows"}} for t in ("gemv", "gemv_gated", "lm_head_last")},
                "dot-rows": {t: {"default": {"FMA_T": 1, "ROW_PASS": "rows"}} for t in ("gemv", "gemv_gated")},
                "dot-block": {t: {"default": {"FMA_T": 1, "ROW_PASS": "block"}} for t in ("gemv", "gemv_gated")},
                # two W tiles read before the PDL wait (the tiny model's K of 96 and 160: one range)
                "dot-pre": {t: {"default": {"FMA_T": 1, "DOT_PRE": 2, "BLOCK_K": 32}} for t in ("gemv", "gemv_gated")},
                # K split in two, the partials parked by plain stores (PARK), each launch's grid the
                # taken path's blocks (GRID "paths", lm_head_last's too)
                "dot-park": {**{t: {"default": {"FMA_T": 1, "BLOCK_K": 32, "FMA_BLOCK_K": 32, "SPLIT_K_DOT": 2,
                                                "PARK": "store", "GRID": "paths"}} for t in ("gemv", "gemv_gated")},
                             "lm_head_last": {"default": {"GRID": "paths"}}},
                # 16-row W blocks on the tensor-core path, unsplit (prepare.py verify-ab's n16u)
                "dot-n16": {t: {"default": {"FMA_T": 1, "BLOCK_N_DOT": 16, "SPLIT_K_DOT": 1}} for t in ("gemv", "gemv_gated")}}


def _interp(d, out: Path, **build_kw):
    """The plan built into `out` (no cubins) and an interpreting executor over it."""
    from infc.compiler.contract.safetensors_io import Checkpoint
    from infc.runtime.weights.load import load_weights
    from interp_executor import InterpExecutor
    build(model_dir=str(d), out=out, compile=False, log=None, page_size=16, narrow_tokens=K + 1, **build_kw)
    plan = json.loads((out / "plan.json").read_text())
    plan["_dir"] = str(out)
    return plan, InterpExecutor(plan, load_weights(plan, Checkpoint(d)), page_size=16)


@pytest.fixture(scope="module")
def decode_reference(tiny_model, tmp_path_factory):
    """A sequence's first K + 1 tokens as one-token rows (each row's context is the keys its
    step's earlier rows write: the prologue's cache write, and no prefill to interpret), and their
    logits through the decode program of a build at the table's defaults: once for every form."""
    d, _ = tiny_model("qwen3", **DIMS)          # tests/test_interp_models.py's (tile-sized heads)
    rows = [Chunk(0, [int(t)], j) for j, t in enumerate(np.random.default_rng(0).integers(0, 320, K + 1))]
    plan, run = _interp(d, tmp_path_factory.mktemp("verify-ref") / "art")
    plan["verify_tokens"] = 0                   # the same step, the same keys, on decode
    decode = run.step(rows)
    assert run.program == "decode"
    return d, rows, decode


# ~8 s each interpreted; the fast suite runs the default (also tests/test_interp_models.py's verify
# step), the CUDA-core rows and the split tensor-core form
@pytest.mark.parametrize("form", [f if f in ("default", "lanes", "dot-park") else pytest.param(f, marks=EXHAUSTIVE) for f in VERIFY_FORMS])
def test_a_verify_step_through_the_verify_program_is_the_decode_programs(decode_reference, tmp_path, form):
    """K + 1 one-token rows of one sequence (its next token and K drafts) through the interpreted
    verify kernels, then the same rows through the decode program of a build at the table's
    defaults (the form's "default" entries reach the decode launches too): the same logits."""
    d, rows, decode = decode_reference
    plan, run = _interp(d, tmp_path / "art", tuning_overlay=VERIFY_FORMS[form])
    out = Path(plan["_dir"])
    verify_srcs = [(out / "kernels" / f"{l['kernel_id']}.py").read_text()
                   for l, _ in launches(plan["programs"]["verify"]) if l["kernel"].startswith("gemv")]
    assert verify_srcs and all(("tl.dot(" in src) == (form != "lanes") for src in verify_srcs)
    if form == "dot-park":
        assert all('"SPLIT": True' in src for src in verify_srcs)
    verify = run.step(rows)
    assert run.program == "verify" and verify.shape[0] == K + 1
    assert float(np.linalg.norm(verify - decode) / np.linalg.norm(decode)) < 2e-2
    assert (np.argmax(verify, -1) == np.argmax(decode, -1)).all()


def test_greedy_speculation_over_the_verify_program_is_plain_decoding(plans, monkeypatch):
    """n-gram speculation on the speculative plan (the reference executor follows program_name
    too): the verify program runs its steps, and the text is plain decoding's."""
    from infc.compiler.contract.safetensors_io import Checkpoint
    from infc.runtime.reference import executor
    from infc.runtime.weights.load import load_weights
    from test_spec_engine import GREEDY, copy_prompts, flat, outputs, spec, tiny_engine
    from infc.runtime.engine.sampling import SamplingParams
    d, _, plan = plans
    weights = load_weights(plan, Checkpoint(d))
    ran = []
    real = executor.program_name
    monkeypatch.setattr(executor, "program_name", lambda *a: ran.append(real(*a)) or ran[-1])
    prompts = copy_prompts(11, 2)
    params = SamplingParams(max_tokens=16, **GREEDY)
    want = flat(outputs(tiny_engine((plan, weights)), prompts, params))
    assert "verify" in ran                          # two sequences decoding: 2 rows
    ran.clear()
    e = tiny_engine((plan, weights), speculative_config=spec(k=K))
    assert flat(outputs(e, prompts, params)) == want
    assert e.metrics.spec_decode_num_accepted_tokens_total > 0 and "verify" in ran
