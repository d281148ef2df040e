"""The experts' bf16 stacks kept resident (compiler/passes/upcast_experts.py, resident mode; infc/
config.py RESIDENT_EXPERT_STACKS_MAX_BYTES): each layer's MXFP4 stacks dequantized once, by the
plan's load program, into derived weights (source {"derived": ...}) that the grouped GEMMs of the
prefill, mixed, short and wide programs read at their rows; no step launches an upcast. On the
tiny GPT-OSS model of tests/test_gpt_oss_mxfp4.py: the load program holds the upcasts and no
other program does; the derived weights are the format's dequantization after load (reference and
interpreted kernels); the logits equal a codes-only build's bit for bit (the GEMMs' bf16 tile is
the codes' tile rounded as the codes GEMM rounds it) through the reference and the kernels, in
prefill, mixed and wide steps; the checkpoint check expects no tensor for them.
"""
import json
import sys

import numpy as np
import pytest

import infc.config
from infc.compiler.build import build, compile_model
from infc.compiler.checkpoint_check import check_model_dir
from infc.compiler.contract.program import launches
from infc.compiler.contract.safetensors_io import Checkpoint
from infc.compiler.ops.quant import dequantize, scheme_of
from infc.runtime.engine.step import Chunk, build_step
from infc.runtime.reference.executor import ReferenceExecutor, SeqChunk
from infc.runtime.weights.load import load_weights

from interp_executor import InterpExecutor
from test_cuda_ranks import cuda_mods, fake_device  # noqa: F401 (fixtures)
from test_gpt_oss_mxfp4 import PROMPT, mxfp4_model  # noqa: F401 (the fixture)

STACKS = ("we_gate_up", "we_down")
GROUPED = ("prefill", "mixed", "short", "wide")


def _resident(monkeypatch, on=True, per_expert=1):
    """Resident stacks on (any size) at `per_expert` tokens an expert (1: rows 2 on 4 experts, 2 a
    token), the per-step upcast off: the other side of the A/B is the codes alone."""
    monkeypatch.setattr(infc.config, "UPCAST_EXPERTS", False)
    monkeypatch.setattr(infc.config, "RESIDENT_EXPERT_STACKS_MAX_BYTES", (1 << 40) if on else 0)
    monkeypatch.setattr(infc.config, "RESIDENT_TOKENS_PER_EXPERT", per_expert)


def _plan(d, out):
    out = build(model_dir=str(d), out=out, compile=False, log=None, page_size=16)
    plan = json.loads((out / "plan.json").read_text())
    plan["_dir"] = str(out)
    return plan


def test_the_load_program_holds_the_upcasts(mxfp4_model, monkeypatch):
    d, _ = mxfp4_model
    _resident(monkeypatch)
    state, plan = compile_model(model_dir=str(d))
    derived = {n: w for n, w in plan["weights"].items() if "derived" in w["source"]}
    assert sorted(derived) == sorted(s + "_bf16" for s in STACKS)
    for n, w in derived.items():
        codes = plan["weights"][n[:-len("_bf16")]]
        assert w["dtype"] == "bf16" and w["shape"] == codes["shape"] and w["layers"] == codes["layers"]
        assert w["source"]["derived"]["by"] == "expert_upcast" and w["source"]["derived"]["from"][0] == n[:-5]
        assert n not in plan["buffers"]
    load = [la for la, _ in launches(plan["programs"]["load"])]
    assert load and all(la["op"] == "expert_upcast" and la["attrs"]["at_load"] and la["attrs"]["rows"] == 1
                        for la in load)
    assert {la["outputs"][0] for la in load} == set(derived)      # (in each layer kind)
    for p, prog in plan["programs"].items():
        if p == "load":
            continue
        assert not any(la["op"] == "expert_upcast" for la, _ in launches(prog)), p
        experts = [la for la, _ in launches(prog) if la["op"] in ("moe_gate_up", "moe_down")]
        assert experts, p
        # every program's expert launches name the stack (the GEMVs leave it unread)
        assert all(la["attrs"]["upcast_resident"] and la["attrs"]["upcast_rows"] == 2
                   and la["inputs"][-1] in derived for la in experts), p
    assert {"prefill", "mixed", "decode", "wide"} <= set(plan["programs"])
    # the checkpoint has no tensor for a derived weight and the check asks for none
    assert check_model_dir(plan, state.spec, d)
    from infc.compiler.inspect import inspect
    shown = inspect(model_dir=str(d))
    assert "== launches: load  (2 per layer, 6 in all; once" in shown and "derived weights" in shown


def test_a_batch_1_step_reads_the_codes_not_the_stacks(mxfp4_model, monkeypatch):
    """bench/active_floor.py: a batch-1 decode step of the resident build reads what the codes
    build's does (the stacks are read at many tokens an expert only), so its floor is the same."""
    from infc.bench.active_floor import active_bytes
    d, _ = mxfp4_model
    _resident(monkeypatch, on=False)
    _, codes = compile_model(model_dir=str(d))
    _resident(monkeypatch)
    _, resident = compile_model(model_dir=str(d))
    assert any("derived" in w["source"] for w in resident["weights"].values())
    assert active_bytes(resident) == active_bytes(codes)


def test_feature_off_leaves_the_plan_as_it_was(mxfp4_model, monkeypatch):
    """Off (0 bytes, the default) or over its budget, the plan is the per-step upcast's (or the
    codes'): no load program, no derived weight."""
    d, _ = mxfp4_model
    monkeypatch.setattr(infc.config, "UPCAST_EXPERTS", True)
    default = compile_model(model_dir=str(d))[1]
    assert infc.config.RESIDENT_EXPERT_STACKS_MAX_BYTES == 0
    _resident(monkeypatch)
    on = compile_model(model_dir=str(d))[1]
    size = sum(2 * np.prod(w["shape"]) * len(w["layers"]) for w in on["weights"].values()
               if "derived" in w["source"])
    monkeypatch.setattr(infc.config, "UPCAST_EXPERTS", True)
    monkeypatch.setattr(infc.config, "RESIDENT_EXPERT_STACKS_MAX_BYTES", int(size) - 1)
    monkeypatch.setattr(infc.config, "RESIDENT_TOKENS_PER_EXPERT", 4)
    over = compile_model(model_dir=str(d))[1]
    for plan in (default, over):
        assert "load" not in plan["programs"]
        assert not any("derived" in w["source"] for w in plan["weights"].values())
    assert json.dumps(over) == json.dumps(default)
    monkeypatch.setattr(infc.config, "RESIDENT_EXPERT_STACKS_MAX_BYTES", int(size))
    assert "load" in compile_model(model_dir=str(d))[1]["programs"]       # at the budget: on


def test_derived_weights_are_the_formats_dequantization_after_load(mxfp4_model, tmp_path, monkeypatch):
    d, _ = mxfp4_model
    _resident(monkeypatch)
    plan = _plan(d, tmp_path / "art")
    loaded = load_weights(plan, Checkpoint(d))
    assert all(not a.any() for s in STACKS for a in loaded[s + "_bf16"])     # zeros until the load program
    ref = ReferenceExecutor(plan, load_weights(plan, Checkpoint(d)))
    run = InterpExecutor(plan, loaded, page_size=16)
    assert [op for op, _ in run.loaded] == ["expert_upcast"] * 2 * len(plan["weights"]["we_down"]["layers"])
    scheme = scheme_of(next(la for la, _ in launches(plan["programs"]["load"]))["attrs"])
    for s in STACKS:
        scales = next(la for la, _ in launches(plan["programs"]["load"]) if la["inputs"][0] == s)["inputs"][1]
        for k, layer in enumerate(plan["weights"][s]["layers"]):
            want = dequantize(loaded[s][k], scheme, loaded[scales][k])
            assert want.any() and np.array_equal(ref.weights[s + "_bf16"][k], want), (s, layer)
            assert np.array_equal(run.weights[s + "_bf16"][k].float().numpy(), want), (s, layer)


def _steps(ex, plan):
    """prefill (16 rows), mixed (a decode beside a 5-token chunk), wide (2 decodes): each step's
    logits and the program it ran on (wide from 2 decodes; every prompt past the short program)."""
    got = {"prefill": ex.step([Chunk(0, PROMPT, 0)])}
    tok = int(np.argmax(got["prefill"][0]))
    got["mixed"] = ex.step([Chunk(0, [tok], len(PROMPT)), Chunk(1, PROMPT[:5], 0)])
    toks = [int(np.argmax(got["mixed"][b])) for b in range(2)]
    got["wide"] = ex.step([Chunk(0, [toks[0]], len(PROMPT) + 1), Chunk(1, [toks[1]], 5)])
    return got


@pytest.mark.parametrize("executor", ["reference", "kernels"])
def test_resident_logits_equal_the_codes_bit_for_bit(mxfp4_model, tmp_path, monkeypatch, executor):
    d, _ = mxfp4_model
    got, programs = {}, {}
    for label, on in (("resident", True), ("codes", False)):
        _resident(monkeypatch, on)
        plan = _plan(d, tmp_path / label)
        assert ("load" in plan["programs"]) == on
        plan["short_tokens"], plan["wide_tokens"] = 0, 2
        weights = load_weights(plan, Checkpoint(d))
        if executor == "reference":
            got[label] = _steps(ReferenceExecutor(plan, weights), plan)
        else:
            ex = InterpExecutor(plan, weights, page_size=16)
            seen = []
            step = ex.step

            def traced(chunks, ex=ex, step=step, seen=seen):
                out = step(chunks)
                seen.append((ex.program, list(ex.templates)))
                return out
            ex.step = traced
            got[label] = _steps(ex, plan)
            programs[label] = seen
    if executor == "kernels":
        for (p, t), want in zip(programs["resident"], ("prefill", "mixed", "wide")):
            assert p == want and not any(op == "expert_upcast" for op, _ in t)
            assert ("moe_gate_up", "moe_gate_up_grouped") in t
    for step in ("prefill", "mixed", "wide"):
        assert np.isfinite(got["resident"][step]).all(), step
        assert np.array_equal(got["resident"][step], got["codes"][step]), step


@pytest.mark.parametrize("executor", ["reference", "kernels"])
def test_the_grouped_programs_read_the_resident_stack_alone(mxfp4_model, tmp_path, monkeypatch, executor):
    """The experts read the derived weight in the prefill, mixed, short and wide programs at their
    rows, the codes below them and in the decode programs, in the reference (ops/expert_upcast.py
    stack_written) as in the kernels (the grouped templates' UP): a stack halved after load moves
    exactly those steps' logits (each stack, gate|up and down, on its own)."""
    d, _ = mxfp4_model
    _resident(monkeypatch, per_expert=2)        # rows 4
    plan = _plan(d, tmp_path / "art")
    plan["short_tokens"], plan["wide_tokens"] = 8, 4

    def make():
        weights = load_weights(plan, Checkpoint(d))
        return ReferenceExecutor(plan, weights) if executor == "reference" else InterpExecutor(plan, weights, page_size=16)
    want, halved = make(), {s: make() for s in STACKS}     # one stack halved in each
    for s, ex in halved.items():
        for a in ex.weights[s + "_bf16"]:
            a *= 0.5
    # (a step's sequences have unmoved caches until it: only its own reads can differ)
    for program, chunks, moved in (
            ("short", [SeqChunk(1, PROMPT[:3], 0)], False),                   # 3 rows: below
            ("narrow", [SeqChunk(1, [5], 3)], False),                         # one decode: the codes
            ("short", [SeqChunk(3, PROMPT[:2], 0)], False),                   # 2 rows
            ("short", [SeqChunk(5, PROMPT[3:4], 0)], False),                  # 1 row
            ("short", [SeqChunk(6, PROMPT[4:7], 0)], False),                  # 3 rows
            ("decode", [SeqChunk(1, [8], 4), SeqChunk(3, [8], 2)], False),    # 2 decodes
            ("wide", [SeqChunk(c, [7], n) for c, n in ((1, 5), (3, 3), (5, 1), (6, 3))], True),  # 4 decodes
            ("prefill", [SeqChunk(0, PROMPT, 0)], True),                      # 16 rows
            ("short", [SeqChunk(2, PROMPT[:6], 0)], True),                    # 6 rows
            ("mixed", [SeqChunk(0, [6], 16), SeqChunk(4, PROMPT[:9], 0)], True)):   # 10 rows
        a = want.step(chunks)
        assert np.isfinite(a).all() and getattr(want, "program", program) == program
        for s, ex in halved.items():
            assert np.array_equal(a, ex.step(chunks)) != moved, (s, program, chunks)


@pytest.mark.parametrize("overlap", ["0", "1"])
def test_cuda_runner_runs_the_load_program_once(overlap, mxfp4_model, tmp_path, monkeypatch, fake_device):
    """runtime/cuda/runner.py on the fake device (tests/test_cuda_ranks.py: the plan's kernels
    under the Triton interpreter): the load program's launches run once, before any graph is
    captured when the weights load first (INFC_LOAD_OVERLAP=0), after the captures and the
    streamed checkpoint's end when they load beside them (=1: the graphs need the derived
    weights' addresses, not their values), and leave the derived weights on the device equal to
    the format's dequantization; a prefill step's logits then equal the reference's."""
    monkeypatch.setenv("INFC_LOAD_OVERLAP", overlap)
    from test_cuda_ranks import FakeCtx, FakeGraph, fake_launch
    d, _ = mxfp4_model
    _resident(monkeypatch)
    plan = _plan(d, tmp_path / "art")
    runner = fake_device.runner
    order = []

    def launched(ctx, fn, grid, block, shared, args):
        order.append(fn.kernel.meta["entry"] if hasattr(fn, "kernel") else "?")
        fake_launch(ctx, fn, grid, block, shared, args)

    class Graph(FakeGraph):
        def __init__(self, ctx, record):
            order.append("capture")
            super().__init__(ctx, record)
    monkeypatch.setattr(runner, "launch", launched)
    monkeypatch.setattr(runner, "Graph", Graph)
    monkeypatch.setattr(sys.modules["infc.runtime.cuda.sampler"], "launch", fake_launch)
    r = runner.CudaRunner(tmp_path / "art", d, max_num_batched_tokens=32, max_num_seqs=2, num_pages=16,
                          buckets=[1], ctx=FakeCtx(64 << 20))
    ups = [i for i, e in enumerate(order) if e == "expert_upcast"]
    assert len(ups) == 2 * len(plan["weights"]["we_down"]["layers"]) and ups == list(range(ups[0], ups[0] + len(ups)))
    if overlap == "0":
        assert ups[0] == 0 and order.index("capture") > ups[-1]
    else:
        assert "capture" in order[:ups[0]] and "capture" not in order[ups[-1]:] and ups[-1] == len(order) - 1
    weights = load_weights(plan, Checkpoint(d))
    ref = ReferenceExecutor(plan, weights)
    for s in STACKS:
        for k, layer in enumerate(plan["weights"][s]["layers"]):
            got = r.ctx.get(r.weights.ptr(s + "_bf16", layer), plan["weights"][s]["shape"], "bf16")
            assert np.array_equal(got, ref.weights[s + "_bf16"][k]), (s, layer)
    meta = build_step([Chunk(0, PROMPT, 0)], lambda i: list(range(2)), r.page_size)
    got, want = r.logits(meta).copy(), ref.step([SeqChunk(0, PROMPT, 0)])
    assert float(np.linalg.norm(got - want) / np.linalg.norm(want)) < 2e-2
    assert order.count("expert_upcast") == len(ups)                  # never again
    r.close()


def test_resident_stacks_over_expert_parallel_ranks(mxfp4_model, monkeypatch):
    """Each data-parallel, expert-parallel rank makes the bf16 stacks of its own experts in its load
    program (the derived weights take the rank's slice of the codes): the ranks' logits equal the
    single-rank codes plan's, whose steps the ranks' grouped GEMMs serve from the stacks."""
    from test_data_parallel import _check, dp
    from test_parallel import ranked, single
    d, _ = mxfp4_model
    _resident(monkeypatch, on=False)
    one = single(d)
    _resident(monkeypatch)
    many, plans = ranked(d, **dp(2))
    for p in plans:
        assert {la["op"] for la, _ in launches(p["programs"]["load"])} == {"expert_upcast"}
        assert p["weights"]["we_gate_up_bf16"]["shape"] == p["weights"]["we_gate_up"]["shape"] == [2, 128, 96]
    assert _check(many, one, [[SeqChunk(0, PROMPT[:9], 0)], [SeqChunk(1, PROMPT[9:], 0)]]) <= 1e-4
