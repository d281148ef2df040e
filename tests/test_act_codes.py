"""FP8 activation codes made once a step (compiler/passes/act_codes.py, issue 42), end to end on a
tiny qwen3 that tools/quantize_model.py writes as fp8 blocks of 32 x 32 (dynamic group-32
activations: several groups a row, so a scale read from the wrong group shows): the plan makes the codes in add_rms_norm_quant's epilogue (q|k|v, gate|up) and in
quantize_act launches (o_proj after attention, down after the gated GEMM), the linears read them,
and the logits do not move by a bit against the same plan built without the pass: through the
reference executor and through every generated kernel (interpreted) in a prefill, a short
prefill and a decode step of two sequences (the decode GEMVs); a narrow step (one token: the
narrow codes path, which this model runs only with the pass) is close to the plan without it.
"""
import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.append(str(Path(__file__).resolve().parent / "gpu"))
from quantize_model import quantize_model  # noqa: E402

from exhaustive import EXHAUSTIVE  # noqa: E402
from infc.compiler.build import compile_model, generate  # noqa: E402
from infc.compiler.contract.safetensors_io import Checkpoint  # noqa: E402
from infc.compiler.plan import dumps  # noqa: E402
from infc.runtime.engine.step import Chunk  # noqa: E402
from infc.runtime.reference.executor import ReferenceExecutor, SeqChunk  # noqa: E402
from infc.runtime.weights.load import load_weights  # noqa: E402


def _rendered(plan, out):
    generate(plan, out, "h100", 16, "sm_90")
    (out / "plan.json").write_text(dumps(plan))
    plan = json.loads((out / "plan.json").read_text())
    plan["_dir"] = str(out)
    return plan


@pytest.fixture(scope="module")
def fp8_dir(tiny_model, tmp_path_factory):
    d, _ = tiny_model("qwen3")
    q = tmp_path_factory.mktemp("fp8")
    quantize_model(d, q, "fp8-block", block=(32, 32))     # act groups of 32: several a row
    return q


@pytest.fixture(scope="module")
def fp8_plans(fp8_dir):
    """(plan with the pass, plan without it, weights), as compiled (rendering is the interpreted
    test's: it costs seconds)."""
    plan, plain = (json.loads(dumps(compile_model(model_dir=str(fp8_dir), skip=skip, log=None)[1]))
                   for skip in ((), ("act_codes",)))
    return plan, plain, load_weights(plan, Checkpoint(fp8_dir))


@pytest.fixture(scope="module")
def merged_plans(tiny_model, tmp_path_factory):
    """(plan, the same with infc/config.py NARROW_MERGE_QUANT_NORMS on, weights) of a tiny qwen3
    whose q, k and v rows are whole blocks (head_dim 32), so q|k|v is one linear as in the served
    models: with the switch its narrow step's norms are in the q|k|v and gate|up GEMVs."""
    import infc.config
    d, _ = tiny_model("qwen3", head_dim=32)
    q = tmp_path_factory.mktemp("fp8-hd32")
    quantize_model(d, q, "fp8-block", block=(32, 32))
    plan = json.loads(dumps(compile_model(model_dir=str(q), log=None)[1]))
    mp = pytest.MonkeyPatch()
    mp.setattr(infc.config, "NARROW_MERGE_QUANT_NORMS", True)
    try:
        merged = json.loads(dumps(compile_model(model_dir=str(q), log=None)[1]))
        # a speculative build's verify program runs the narrow launches 3 rows wide
        verify = [json.loads(dumps(compile_model(model_dir=str(q), log=None, narrow_tokens=3)[1]))]
        mp.setattr(infc.config, "NARROW_MERGE_QUANT_NORMS", False)
        verify.insert(0, json.loads(dumps(compile_model(model_dir=str(q), log=None, narrow_tokens=3)[1])))
    finally:
        mp.undo()
    return plan, merged, load_weights(plan, Checkpoint(q)), verify


def _launches(plan, program):
    from infc.compiler.contract.program import unrolled
    return [launch for launch, _ in unrolled(plan["programs"][program])]


def test_plan_makes_the_codes_once_and_the_linears_read_them(fp8_plans):
    plan, plain, _ = fp8_plans
    for program in ("prefill", "decode", "narrow", "wide"):
        launches = _launches(plan, program)
        ops = [launch["op"] for launch in launches]
        assert "add_rms_norm_quant" in ops and "quantize_act" in ops, program
        linears = [launch for launch in launches if launch["op"] in ("linear", "linear_gated")
                   and launch["attrs"].get("quant")]
        assert linears and all(launch["attrs"].get("has_a_scale") for launch in linears), program
        made = {o for launch in launches if launch["op"] in ("add_rms_norm_quant", "quantize_act")
                for o in launch["outputs"]}
        # a quantize_act run in its producer's launch (merge_epilogues: the narrow gated GEMV's)
        made |= {o for launch in launches if launch.get("epilogue") for o in launch["outputs"][-2:]}
        for launch in linears:
            assert launch["inputs"][0] in made and launch["inputs"][-1] in made
            assert plan["buffers"][launch["inputs"][0]]["dtype"] == "f8e4m3"
    # without the pass the linears quantize bf16 A themselves (and this model merges no norm into a
    # narrow GEMV, so it has no narrow program: with ready codes it has one, for the codes path)
    assert not any(launch["attrs"].get("has_a_scale") for launch in _launches(plain, "decode"))
    assert "narrow" not in plain["programs"]


def test_reference_logits_do_not_move(fp8_plans):
    plan, plain, weights = fp8_plans
    toks = [int(t) for t in np.random.default_rng(1).integers(0, 300, 23)]
    got = ReferenceExecutor(plan, weights).step([SeqChunk(0, toks, 0)])
    want = ReferenceExecutor(plain, weights).step([SeqChunk(0, toks, 0)])
    assert np.isfinite(got).all() and np.array_equal(got, want)


@EXHAUSTIVE       # ~17 s interpreted; the consumers' bit identity is tests/kernels/test_act_codes_kernels.py's
def test_kernels_logits_do_not_move(fp8_plans, tmp_path):
    """Every generated kernel, interpreted, with and without the pass: the same bits; and near the
    reference."""
    from interp_executor import InterpExecutor
    plan, plain, weights = fp8_plans
    plan, plain = _rendered(plan, tmp_path / "a"), _rendered(plain, tmp_path / "b")
    narrow = [launch["kernel_id"] for launch in _launches(plan, "narrow") if launch["op"] in ("linear", "linear_gated")]
    assert narrow and all(_codes_path(plan, k) for k in narrow)
    rng = np.random.default_rng(3)
    a, b = [int(t) for t in rng.integers(0, 300, 21)], [int(t) for t in rng.integers(0, 300, 9)]
    runs = []
    for p in (plan, plain):
        p["short_tokens"] = 16                     # a: prefill (GEMMs); b: short (GEMVs)
        run, ref, out = InterpExecutor(p, weights, page_size=16), ReferenceExecutor(p, weights), []
        for seq, toks in ((0, a), (1, b)):
            out.append(run.step([Chunk(seq, toks, 0)]))
            # the reference quantizes float32 activations, the kernels bf16 ones: an e4m3 code
            # moves a step now and then, 5e-2 on this model (tests/test_quant_moe.py says why)
            assert rel(out[-1], ref.step([SeqChunk(seq, toks, 0)])) < 1e-1
        out.append(run.step([Chunk(0, [5], len(a)), Chunk(1, [9], len(b))]))    # decode
        assert run.program == "decode"
        narrow = run.step([Chunk(0, [7], len(a) + 1)])
        runs.append(out + [narrow, run.program])
    for got, want in zip(runs[0][:3], runs[1][:3]):
        assert np.isfinite(got).all() and np.array_equal(got, want)
    # one token: the narrow codes path (tensor-core e4m3 dots) where the plan without the pass runs
    # the decode GEMV's CUDA-core loop: the same products, summed in another order
    assert runs[0][4] == "narrow" and runs[1][4] == "decode"
    assert np.isfinite(runs[0][3]).all() and rel(runs[0][3], runs[1][3]) < 2e-2


@EXHAUSTIVE     # ~10 s interpreted
def test_the_merged_verify_rows_give_the_same_logits(merged_plans, tmp_path):
    """A verify step (3 rows of one sequence) through the interpreted verify kernels with the
    switch on and off: each row's codes made by the GEMV's programs are the norm's, so the same
    logits bit for bit."""
    from interp_executor import InterpExecutor
    *_, weights, verify = merged_plans
    assert any(launch.get("prologue", {}).get("op") == "add_rms_norm" and launch["op"] == "linear_gated"
               for launch in _launches(verify[1], "verify"))
    rows = [Chunk(0, [int(t)], j) for j, t in enumerate(np.random.default_rng(5).integers(0, 300, 3))]
    out = []
    for p, d in zip(verify, (tmp_path / "a", tmp_path / "b")):
        run = InterpExecutor(_rendered(p, d), weights, page_size=16)
        out.append(run.step(rows))
        assert run.program == "verify"
    assert np.isfinite(out[1]).all() and np.array_equal(out[0], out[1])


def _codes_path(plan, kid) -> bool:
    """Whether kernel kid is a narrow codes path (gemv.py.j2 NDOT), in either FP8_FORM."""
    src = (Path(plan["_dir"]) / plan["kernels"][kid]["source"]).read_text()
    return "_run_sums(" in src or "tl.dot(raw, tl.trans(ac))" in src


def test_the_narrow_norms_merge_into_the_gemvs_when_switched_on(merged_plans):
    """NARROW_MERGE_QUANT_NORMS: the narrow step has no add_rms_norm_quant; q|k|v and gate|up take
    the plain norm as their prologue and read h, not codes (no has_a_scale, no scales input);
    o and down keep their ready codes. Off (the default) the narrow step is as before; the other
    programs are the same either way."""
    plan, merged_plan, _, _ = merged_plans
    ops = lambda p, prog: [launch["op"] for launch in _launches(p, prog)]  # noqa: E731
    assert ops(plan, "narrow").count("add_rms_norm_quant") == 6 and "add_rms_norm_quant" not in ops(merged_plan, "narrow")
    merged = [launch for launch in _launches(merged_plan, "narrow") if launch.get("prologue")
              and launch["prologue"]["op"] == "add_rms_norm"]
    assert sorted(launch["op"] for launch in merged) == ["linear"] * 3 + ["linear_gated"] * 3
    for launch in merged:
        assert not launch["attrs"].get("has_a_scale") and launch["attrs"]["quant"]
        assert merged_plan["buffers"][launch["prologue"]["value"]]["dtype"] == "bf16"
        assert len(launch["inputs"]) == 3 + 2 and merged_plan["buffers"][launch["outputs"][0]]["dtype"] == "bf16"
    ready = [launch for launch in _launches(merged_plan, "narrow") if launch["op"] == "linear" and not launch.get("prologue")]
    assert len(ready) == 6 and all(launch["attrs"].get("has_a_scale") for launch in ready)
    for program in ("prefill", "decode", "wide"):
        assert merged_plan["programs"][program] == plan["programs"][program]


def test_the_merged_narrow_step_gives_the_same_logits(merged_plans, tmp_path):
    """The merged narrow launches make the codes the norm made (the same definition): the
    reference's narrow steps are bit for bit the unmerged plan's, and every kernel interpreted
    (the per-program codes of the narrow codes path) too."""
    from interp_executor import InterpExecutor
    plan, merged_plan, weights, _ = merged_plans
    rng = np.random.default_rng(4)
    a = [int(t) for t in rng.integers(0, 300, 19)]
    steps = [[Chunk(0, a, 0)], [Chunk(0, [7], len(a))], [Chunk(0, [11], len(a) + 1)]]
    ref = []
    for p in (plan, merged_plan):
        run = ReferenceExecutor(p, weights)
        ref.append([run.step(chunks) for chunks in steps])
    for got, want in zip(*ref):
        assert np.isfinite(got).all() and np.array_equal(got, want)
    out = []
    for p, d in ((plan, tmp_path / "a"), (merged_plan, tmp_path / "b")):
        p = _rendered(p, d)
        run = InterpExecutor(p, weights, page_size=16)
        logits = [run.step(chunks) for chunks in steps]
        assert run.program == "narrow"
        out.append(logits)
    narrow = [launch["kernel_id"] for launch in _launches(p, "narrow") if launch.get("prologue")
              and launch["op"] in ("linear", "linear_gated")]
    assert len(narrow) == 6 and all(_codes_path(p, k) for k in narrow)
    for got, want in zip(*out):
        assert np.isfinite(got).all() and np.array_equal(got, want)


def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))
