"""o_proj's fp8 activation codes in decode attention's epilogue (compiler/passes/merge_epilogues.py,
issue 42), end to end on a tiny qwen3 with head_dim 32 written as fp8 blocks of 32 x 32 (dynamic
activation groups of 32: one group a head): the narrow and decode programs run o_proj's quantize_act
inside attention's launch, the narrow program down's inside the gated GEMV's (no quantize_act
launch left there), prefill and mixed keep the launches, and
the decode steps' logits do not move by a bit against the same plan built without the merge, through
the reference executor and through every generated kernel (interpreted)."""
import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.append(str(Path(__file__).resolve().parent / "gpu"))
from quantize_model import quantize_model  # noqa: E402

from exhaustive import EXHAUSTIVE  # noqa: E402
from infc.compiler.build import compile_model, generate  # noqa: E402
from infc.compiler.contract.program import unrolled  # noqa: E402
from infc.compiler.contract.schema import DTYPE_BYTES  # noqa: E402
from infc.compiler.contract.safetensors_io import Checkpoint  # noqa: E402
from infc.compiler.plan import dumps  # noqa: E402
from infc.runtime.engine.step import Chunk  # noqa: E402
from infc.runtime.reference.executor import ReferenceExecutor, SeqChunk  # noqa: E402
from infc.runtime.weights.load import load_weights  # noqa: E402


@pytest.fixture(scope="module")
def fp8_dir(tiny_model, tmp_path_factory):
    """The tiny qwen3 with head_dim 32, written as fp8 blocks of 32 x 32."""
    d, _ = tiny_model("qwen3", head_dim=32)
    q = tmp_path_factory.mktemp("fp8-hd32")
    quantize_model(d, q, "fp8-block", block=(32, 32))
    return q


@pytest.fixture(scope="module")
def plans(fp8_dir):
    """(plan, the plan without merge_epilogues, weights) of the tiny fp8 qwen3 with head_dim 32."""
    q = fp8_dir
    plan, plain = (json.loads(dumps(compile_model(model_dir=str(q), skip=skip, log=None)[1]))
                   for skip in ((), ("merge_epilogues",)))
    return plan, plain, load_weights(plan, Checkpoint(q))


def _overlap(plan, a, b, T):
    """Whether buffers a and b share a byte in a step of T tokens (T sequences)."""
    def span(name):
        buf = plan["buffers"][name]
        off = buf["offset"]
        start = off["T"] * T + off["B"] * T + off["bytes"]
        size = DTYPE_BYTES[buf["dtype"]] * int(np.prod([T if isinstance(d, str) else d for d in buf["shape"]]))
        return start, start + size
    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def _ops(plan, program):
    return [launch for launch, _ in unrolled(plan["programs"][program])]


def test_narrow_attention_makes_o_projs_codes(plans):
    plan, plain, _ = plans
    narrow = _ops(plan, "narrow")
    attn = [launch for launch in narrow if launch["op"] == "attention_cached"]
    assert attn and all(launch.get("epilogue", {}).get("op") == "quantize_act" for launch in attn)
    o_proj = [launch for launch in narrow if launch["op"] == "linear" and launch["inputs"][0] in
              {o for a in attn for o in a["outputs"]}]
    assert len(o_proj) == len(attn)               # every o_proj reads its codes from attention's launch
    # down's codes from the gated GEMV's launch: no quantize_act left in the narrow program (two
    # launches fewer a layer); in the decode program the gated GEMV's stays
    gated = [launch for launch in narrow if launch["op"] == "linear_gated"]
    assert gated and all(launch.get("epilogue", {}).get("op") == "quantize_act" for launch in gated)
    down = [launch for launch in narrow if launch["op"] == "linear" and launch["inputs"][0] in
            {o for a in gated for o in a["outputs"]}]
    assert len(down) == len(gated)
    for a in attn + gated:
        assert plan["buffers"][a["outputs"][-2]]["dtype"] == "f8e4m3"
        assert plan["buffers"][a["outputs"][-1]]["dtype"] == "f32"
        # the codes are written while the launch's programs still read its inputs (plan_memory
        # keeps those live to the codes' place): no byte shared, at any step size
        for T in (1, 5):
            for o in a["outputs"][-2:]:
                assert not any(_overlap(plan, o, i, T) for i in a["inputs"] if i in plan["buffers"]), (o, T)
    count = lambda p, prog, op: sum(launch["op"] == op for launch in _ops(p, prog))   # noqa: E731
    layers = len(attn)
    assert count(plan, "narrow", "quantize_act") == 0 and count(plain, "narrow", "quantize_act") == 2 * layers
    assert len(narrow) == len(_ops(plain, "narrow")) - 2 * layers
    assert [l["op"] for l in _ops(plan, "decode")].count("quantize_act") == layers    # decode: the same merge
    assert all(l.get("epilogue") for l in _ops(plan, "decode") if l["op"] == "attention_cached")
    for program in ("prefill", "mixed"):
        assert _ops(plan, program) == _ops(plain, program), program


def test_a_speculative_builds_narrow_program_merges_downs_codes_too(plans, fp8_dir):
    """A speculative build (narrow_tokens = k + 1: a verify program beside the one-row narrow
    program) merges down's codes into the narrow program's gated GEMV as a one-token build does;
    its verify program (k + 1 rows: no codes epilogue) keeps the quantize_act launches, and every
    kernel of it renders."""
    from infc.compiler.codegen.render import launch_context, render_template
    plan, _, _ = plans
    spec = json.loads(dumps(compile_model(model_dir=str(fp8_dir), log=None, narrow_tokens=5)[1]))
    assert spec["verify_tokens"] == 5
    assert spec["programs"]["narrow"] == plan["programs"]["narrow"]
    gated = [l for l in _ops(spec, "narrow") if l["op"] == "linear_gated"]
    assert gated and all(l.get("epilogue", {}).get("op") == "quantize_act" for l in gated)
    assert not any(l["op"] == "quantize_act" for l in _ops(spec, "narrow"))
    verify = _ops(spec, "verify")
    assert not any(l.get("epilogue") for l in verify)
    assert sum(l["op"] == "quantize_act" for l in verify) == 2 * len(gated)
    # the verify rows' fp8 GEMVs render (its k + 1 rows on the CUDA-core path, reading ready codes)
    for l in {l["kernel"] + repr(l["inputs"]): l for l in verify if l["op"] in ("linear", "linear_gated")}.values():
        k = render_template("triton", l["kernel"], launch_context(spec, l, "verify", {}, 16))
        assert k.meta["constexprs"]["FMA_T"] == 5 and "tl.dot(" not in k.source


def test_reference_logits_do_not_move(plans):
    plan, plain, weights = plans
    a, b = ([int(t) for t in np.random.default_rng(1).integers(0, 300, n)] for n in (11, 5))
    out = []
    for p in (plan, plain):
        ref = ReferenceExecutor(p, weights)
        ref.step([SeqChunk(0, a, 0)])
        ref.step([SeqChunk(1, b, 0)])
        out.append(ref.step([SeqChunk(0, [7], len(a))]))                         # the narrow program
        out.append(ref.step([SeqChunk(0, [8], len(a) + 1), SeqChunk(1, [9], len(b))]))   # decode
    for got, want in zip(out[:2], out[2:]):
        assert np.isfinite(got).all() and np.array_equal(got, want)


@EXHAUSTIVE      # ~26 s interpreted; the epilogue's bits are tests/kernels/test_attention_decode_codes.py's
def test_kernels_logits_do_not_move(plans, tmp_path):
    """A narrow and a decode step through every generated kernel (interpreted), with and without
    the merge: the same bits (o_proj reads the same codes), and near the reference."""
    from interp_executor import InterpExecutor
    plan, plain, weights = plans
    toks = [int(t) for t in np.random.default_rng(2).integers(0, 300, 6)]
    out = []
    for p, name in ((plan, "a"), (plain, "b")):
        generate(p, tmp_path / name, "h100", 16, "sm_90")
        (tmp_path / name / "plan.json").write_text(dumps(p))
        p = json.loads((tmp_path / name / "plan.json").read_text())
        p["_dir"] = str(tmp_path / name)
        run = InterpExecutor(p, weights, page_size=16)
        run.step([Chunk(0, toks, 0)])
        run.step([Chunk(1, toks[:3], 0)])
        out.append(run.step([Chunk(0, [7], len(toks))]))
        assert run.program == "narrow"
        out.append(run.step([Chunk(0, [8], len(toks) + 1), Chunk(1, [9], 3)]))
        assert run.program == "decode"
    ref = ReferenceExecutor(plan, weights)
    ref.step([SeqChunk(0, toks, 0)])
    want = ref.step([SeqChunk(0, [7], len(toks))])
    for got, plain_got in zip(out[:2], out[2:]):
        assert np.isfinite(got).all() and np.array_equal(got, plain_got)
    # the reference quantizes float32 activations, the kernels bf16 ones (tests/test_act_codes.py)
    assert float(np.linalg.norm(out[0] - want) / np.linalg.norm(want)) < 1e-1
