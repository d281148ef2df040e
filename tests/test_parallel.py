"""Tensor and expert parallelism as plan transforms, checked on the CPU with simulated ranks:
the N rank plans (compiler/parallel.py) run together in runtime/reference/ranks.py and must
give the single-rank plan's logits (float32, 1e-4) at every position of a 16-token prompt.

The tiny fixtures have 4 query heads; TP 4 needs 4 kv heads, so those cases build the tiny
models with num_key_value_heads=4 (replicating kv heads across ranks is out of scope)."""
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from infc.cli import main
from infc.compiler.build import compile_model
from infc.compiler.contract.errors import SpecError
from infc.compiler.ops import REGISTRY
from infc.compiler.build import compile_ranks
from infc.compiler.parallel import settings
from infc.compiler.contract.caches import unit_elems
from infc.compiler.contract.program import unrolled
from infc.runtime.reference.executor import ReferenceExecutor, SeqChunk
from infc.runtime.reference.ranks import RankExchange, RankExecutor
from infc.compiler.contract.safetensors_io import Checkpoint
from infc.runtime.weights.load import load_weights

from exhaustive import EXHAUSTIVE

TOL = 1e-4

CASES = [   # (family, fixture overrides, settings)
    ("qwen3", {}, dict(tensor_parallel_size=2)),
    ("qwen3", {"num_key_value_heads": 4}, dict(tensor_parallel_size=4)),
    ("qwen3_moe", {}, dict(tensor_parallel_size=2)),
    ("qwen3_moe", {"num_key_value_heads": 4}, dict(tensor_parallel_size=4)),
    ("qwen3_moe", {}, dict(expert_parallel_only=2)),                     # EP, attention replicated
    ("qwen3_moe", {}, dict(expert_parallel_only=4)),
    ("qwen3_moe", {}, dict(tensor_parallel_size=2, enable_expert_parallel=True)),   # TP x EP
    ("qwen3_moe", {"num_key_value_heads": 4}, dict(tensor_parallel_size=4, enable_expert_parallel=True)),
    ("qwen3_moe", {"mlp_only_layers": [1]}, dict(tensor_parallel_size=2, enable_expert_parallel=True)),
]


def _ids(case):
    fam, over, par = case
    return f"{fam}-{'-'.join(f'{k}{v}' for k, v in {**over, **par}.items())}"


def single(d):
    _, plan = compile_model(model_dir=str(d))
    return ReferenceExecutor(plan, load_weights(plan, Checkpoint(d)))


def ranked(d, **kw):
    ranks = compile_ranks(settings(**kw), model_dir=str(d))
    plans = [p for _, p in ranks]
    return RankExecutor(plans, [load_weights(p, Checkpoint(d)) for p in plans]), plans


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_ranks_give_the_single_rank_logits(case, tiny_model, rng):
    fam, over, par = case
    d, _ = tiny_model(fam, **over)
    ids = [int(t) for t in rng.integers(0, 320, 16)]
    one, (many, plans) = single(d), ranked(d, **par)
    world = len(plans)
    assert world == max(par.get("tensor_parallel_size", 1), par.get("expert_parallel_only", 1))
    # prefill of the whole prompt, then the prompt again one token per step: every position
    assert np.abs(many.step([SeqChunk(0, ids, 0)]) - one.step([SeqChunk(0, ids, 0)])).max() <= TOL
    worst = 0.0
    for pos, t in enumerate(ids):
        got = many.step([SeqChunk(1, [t], pos)])
        want = one.step([SeqChunk(1, [t], pos)])
        worst = max(worst, float(np.abs(got - want).max()))
        for r in range(1, world):   # the all_reduce gives every rank the same bits
            assert np.array_equal(many.logits[r], many.logits[0])
    assert worst <= TOL, worst
    # a mixed step: one sequence prefills while the other decodes
    a = [int(t) for t in rng.integers(0, 320, 5)]
    step = [SeqChunk(1, [ids[0]], len(ids)), SeqChunk(2, a, 0)]
    assert np.abs(many.step(step) - one.step(step)).max() <= TOL


def test_ranks_without_fusion(tiny_model, rng):
    """--no-fuse: the generic launches around the collectives give the same logits."""
    d, _ = tiny_model("qwen3_moe", mlp_only_layers=[1])
    ids = [int(t) for t in rng.integers(0, 320, 16)]
    plans = [p for _, p in compile_ranks(settings(tensor_parallel_size=2, enable_expert_parallel=True),
                                         model_dir=str(d), fuse=False)]
    many = RankExecutor(plans, [load_weights(p, Checkpoint(d)) for p in plans])
    one = single(d)
    assert np.abs(many.step([SeqChunk(0, ids, 0)]) - one.step([SeqChunk(0, ids, 0)])).max() <= TOL


@pytest.mark.parametrize("case", [CASES[1], CASES[7]], ids=_ids)
def test_rank_plans_shard_weights_and_caches(case, tiny_model):
    fam, over, par = case
    d, _ = tiny_model(fam, **over)
    _, whole = compile_model(model_dir=str(d))
    plans = [p for _, p in compile_ranks(settings(**par), model_dir=str(d))]
    n = len(plans)
    for r, p in enumerate(plans):
        assert p["parallel"] == {"world": n, "rank": r, "tp": par["tensor_parallel_size"],
                                 "ep": n if par.get("enable_expert_parallel") else 1}
        assert unit_elems(p["caches"]["k"]) * n == unit_elems(whole["caches"]["k"])   # kv heads split
        assert p["weights"]["wqkv"]["shape"][0] * n == whole["weights"]["wqkv"]["shape"][0]
        wo = p["weights"]["wo"]["source"]             # row-parallel: rank r's columns
        assert wo["slice"] and wo["axis"] == 1 and wo["start"] == r * p["weights"]["wo"]["shape"][1]
        assert p["weights"]["embed"] == whole["weights"]["embed"]                   # replicated
        assert p["weights"].get("lm_head") == whole["weights"].get("lm_head")
        ops = [l["op"] for l, _ in unrolled(p["programs"]["decode"])]
        assert ops.count("all_reduce") >= 3                       # one per sublayer with TP
        for l, _ in unrolled(p["programs"]["decode"]):
            if REGISTRY[l["op"]].collective:
                assert l["backend"] == "nccl" and l["kernel"] is None
        # the row linears (wo, the dense down projections) write fp32 partial sums; the
        # all_reduce after each rounds the ranks' sum once, to the stream's bf16
        producer = {o: l for l, _ in unrolled(p["programs"]["decode"]) for o in l["outputs"]}
        for l, _ in unrolled(p["programs"]["decode"]):
            if l["op"] != "all_reduce":
                continue
            x, y = (p["buffers"][l[k][0]]["dtype"] for k in ("inputs", "outputs"))
            src = producer[l["inputs"][0]]["op"]
            assert y == "bf16" and x == ("f32" if src in ("linear", "linear_act_mul") else "bf16"), (src, x, y)
        assert any(p["buffers"][producer[l["inputs"][0]]["outputs"][0]]["dtype"] == "f32"
                   for l, _ in unrolled(p["programs"]["decode"]) if l["op"] == "all_reduce")
        if "we_down" in p["weights"]:
            E = whole["weights"]["we_down"]["shape"][0]
            down = p["weights"]["we_down"]
            assert down["shape"][0] == E // n and down["source"]["start"] == r * E // n
            assert "ep_dispatch" in ops and "ep_combine" in ops
    # every rank runs the same kernels: the launches differ only in the weights they read
    strip = [[(l["op"], l["kernel"], json.dumps(l["attrs"], sort_keys=True))
              for l, _ in unrolled(p["programs"]["prefill"])] for p in plans]
    assert all(s == strip[0] for s in strip)


@pytest.mark.parametrize("family", ["gemma2", "gpt2", "cohere"])
def test_tp2_on_other_families(family, family_model, rng):
    """Model-agnostic: post-norms and logit softcaps (gemma2), checkpoint-fused q|k|v sliced by
    the spec and a row-parallel bias added by rank 0 only (gpt2), a parallel attention + MLP
    block (cohere)."""
    d, _ = family_model(family)
    ids = [int(t) for t in rng.integers(0, 200, 12)]
    one, (many, _) = single(d), ranked(d, tensor_parallel_size=2)
    assert np.abs(many.step([SeqChunk(0, ids, 0)]) - one.step([SeqChunk(0, ids, 0)])).max() <= TOL
    for pos in range(len(ids), len(ids) + 3):
        step = [SeqChunk(0, [ids[pos % len(ids)]], pos)]
        assert np.abs(many.step(step) - one.step(step)).max() <= TOL


def test_expert_parallel_rank_reads_only_its_experts(tiny_model):
    from infc.runtime.weights.load import iter_weights
    d, _ = tiny_model("qwen3_moe")
    ranks = compile_ranks(settings(expert_parallel_only=4), model_dir=str(d))
    ckpt = Checkpoint(d)
    for r, (_, plan) in enumerate(ranks):
        read = []
        for _ in iter_weights(plan, ckpt, read=lambda n: read.append(n) or ckpt.float32(n)):
            pass
        experts = {int(n.split(".experts.")[1].split(".")[0]) for n in read if ".experts." in n}
        assert experts == {2 * r, 2 * r + 1}


def test_engine_on_simulated_ranks_generates_the_single_rank_tokens(tiny_model, rng):
    """The engine (paged caches, prefix cache, batching) over TP x EP ranks: rank 0's metadata
    serves every rank (page ids are the same on every rank), rank 0 samples."""
    from families import engine_greedy
    from infc.runtime.reference.ranks import rank_runner
    from infc.runtime.engine.runner import CPURunner
    d, _ = tiny_model("qwen3_moe")
    _, plan = compile_model(model_dir=str(d))
    plans = [p for _, p in compile_ranks(settings(tensor_parallel_size=2, enable_expert_parallel=True),
                                         model_dir=str(d))]
    runners = [CPURunner(plan, load_weights(plan, Checkpoint(d)), 32),
               rank_runner(plans, [load_weights(p, Checkpoint(d)) for p in plans], 32)]
    prompts = [[int(t) for t in rng.integers(0, 320, n)] for n in (11, 4, 19)]
    outs = [engine_greedy(runner, prompts, 8) for runner in runners]
    assert outs[0] == outs[1] and all(len(t) == 8 for t in outs[0].values())


def test_single_rank_plan_has_no_parallel_section(tiny_model):
    d, _ = tiny_model("qwen3")
    _, plan = compile_model(model_dir=str(d))
    assert "parallel" not in plan
    assert not any(REGISTRY[l["op"]].collective for l, _ in unrolled(plan["programs"]["decode"]))


def test_collective_references_simulate_the_ranks(rng):
    class Ctx:
        pass

    xs = [rng.standard_normal((5, 6)).astype(np.float32) for _ in range(3)]
    ex = RankExchange(3)
    ex.current = [[x] for x in xs]
    for r in range(3):
        c = Ctx()
        c.rank, c.world, c.exchange = r, 3, ex
        assert np.allclose(REGISTRY["all_reduce"].reference(c, xs[r]), xs[0] + xs[1] + xs[2])
        got = REGISTRY["all_gather"].reference(c, xs[r], axis=1, world=3)   # the attrs a launch carries
        assert np.array_equal(got, np.concatenate(xs, axis=1))
    alone = Ctx()          # one rank: collectives are the identity
    alone.exchange = None
    assert np.array_equal(REGISTRY["all_reduce"].reference(alone, xs[0]), xs[0])


def test_expert_dispatch_and_combine_equal_all_experts(rng):
    from infc.compiler.ops import moe

    class Ctx:
        pass

    T, H, E, F, k, N = 7, 8, 8, 6, 3, 4
    x = rng.standard_normal((T, H)).astype(np.float32)
    w, ids = moe.route(None, rng.standard_normal((T, E)).astype(np.float32), k=k, normalize=True)
    gu = rng.standard_normal((E, 2 * F, H)).astype(np.float32)
    dn = rng.standard_normal((E, H, F)).astype(np.float32)
    want = moe.down(None, moe.gate_up(None, x, ids, gu), w, ids, dn)
    ex = RankExchange(N)
    ex.current = [[x, w, ids]] * N
    partial = []
    for r in range(N):
        c = Ctx()
        c.rank, c.world, c.exchange = r, N, ex
        xr, wr, idr = REGISTRY["ep_dispatch"].reference(c, x, w, ids, experts_per_rank=E // N)
        mine = ids // (E // N) == r
        assert idr.max() < E // N and np.all((idr >= 0) == (mine | ~mine.any(1)[:, None] & (np.arange(k) == 0)))
        assert np.all(idr[~mine.any(1), 0] == 0)                # a token with none here: slot 0, expert 0
        assert np.all((wr != 0) == mine)                        # only this rank's experts count
        s = slice(r * E // N, (r + 1) * E // N)
        partial.append(moe.down(None, moe.gate_up(None, xr, idr, gu[s]), wr, idr, dn[s]))
    ex.current = [[p] for p in partial]
    for r in range(N):
        c = Ctx()
        c.rank, c.world, c.exchange = r, N, ex
        assert np.abs(REGISTRY["ep_combine"].reference(c, partial[r]) - want).max() <= 1e-5


# -- malformed settings: a clear message, exit 2 through `infc build` -------------------------

BAD = [
    ("qwen3", {}, ["--tensor-parallel-size", "3"], "does not divide the 4 query heads"),
    ("qwen3", {}, ["--tensor-parallel-size", "4"], "does not divide the 2 kv heads"),
    ("qwen3_moe", {"num_key_value_heads": 4}, ["--tensor-parallel-size", "4",
                                              "--enable-expert-parallel"], None),   # fine: 8 / 4
    ("qwen3", {}, ["--tensor-parallel-size", "2", "--enable-expert-parallel"], "has no experts"),
    ("qwen3", {}, ["--enable-expert-parallel"], "give --tensor-parallel-size N > 1"),
    ("qwen3", {}, ["--tensor-parallel-size", "0"], "must be a positive integer"),
]


@pytest.mark.parametrize("fam,over,flags,message", BAD)
def test_malformed_parallel_settings_exit_2(fam, over, flags, message, tiny_model, tmp_path, capsys):
    d, _ = tiny_model(fam, **over)
    rc = main(["build", "--model-path", str(d), "--no-compile", "--out", str(tmp_path / "o"), *flags])
    err = capsys.readouterr().err
    if message is None:
        assert rc == 0, err
        assert sorted(p.name for p in (tmp_path / "o").glob("plan.rank*.json")) == \
            [f"plan.rank{r}.json" for r in range(4)]
        return
    assert rc == 2, err
    assert message in err and "Traceback" not in err


def test_experts_not_divisible_by_ranks(tiny_model):
    d, _ = tiny_model("qwen3_moe", num_attention_heads=6, num_key_value_heads=6)   # E = 8
    with pytest.raises(SpecError, match="8 experts are not divisible by 3"):
        compile_ranks(settings(tensor_parallel_size=3, enable_expert_parallel=True), model_dir=str(d))


def test_tp_refuses_an_op_it_cannot_shard():
    """OLMo 2 normalizes q over all heads at once ([T, Hq*D]): splitting heads would change it."""
    with pytest.raises(SpecError, match="rms_norm works across the whole feature axis"):
        compile_ranks(settings(tensor_parallel_size=2), model="olmo-2-1124-7b")


def test_inspect_shows_each_ranks_collectives(tiny_model):
    from infc.compiler.inspect import inspect
    d, _ = tiny_model("qwen3_moe")
    text = inspect(model_dir=str(d), phases=["decode"], tensor_parallel_size=2,
                   enable_expert_parallel=True)
    assert "rank 0 of 2" in text and "rank 1 of 2" in text
    assert text.count("== collectives") == 2
    assert "ep_dispatch" in text and "all_reduce" in text


@pytest.mark.parametrize("fmt,options,tp", [("ct-int", {"bits": 4, "group": 16}, 2),
                                            pytest.param("ct-int", {"bits": 8, "group": 8, "sym": False}, 4,
                                                         marks=EXHAUSTIVE)])
def test_quantized_ranks_give_the_single_rank_logits(fmt, options, tp, tiny_model, rng, tmp_path):
    """A quantized checkpoint under tensor parallelism: each rank reads its slice of the codes
    (column-parallel rows, row-parallel columns: packed int4 included) and the scale blocks and
    groups that slice spans; the ranks' logits are the single plan's (weight-only formats: no
    activation quantizer for a last-bit difference to flip)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    from quantize_model import quantize_model
    d, _ = tiny_model("qwen3", num_key_value_heads=4)
    quantize_model(d, tmp_path / "q", fmt, **options)
    ids = [int(t) for t in rng.integers(0, 320, 12)]
    one, (many, plans) = single(tmp_path / "q"), ranked(tmp_path / "q", tensor_parallel_size=tp)
    assert plans[1]["weights"]["wo"]["dtype"] == ("u4" if options["bits"] == 4 else "u8")
    assert np.abs(many.step([SeqChunk(0, ids, 0)]) - one.step([SeqChunk(0, ids, 0)])).max() <= TOL
    for pos, t in enumerate(ids[:4]):
        assert np.abs(many.step([SeqChunk(1, [t], pos)]) - one.step([SeqChunk(1, [t], pos)])).max() <= TOL


def test_quantized_ranks_refuse_a_split_inside_a_scale_block(tiny_model, tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    from quantize_model import quantize_model
    from infc.compiler.contract.errors import ModelDirError
    d, _ = tiny_model("qwen3", num_key_value_heads=4)
    quantize_model(d, tmp_path / "q", "ct-int", bits=4, group=None)        # per channel: any split
    ranked(tmp_path / "q", tensor_parallel_size=2)
    quantize_model(d, tmp_path / "b", "fp8-block", block=(32, 16))      # 48 rows a rank
    with pytest.raises(ModelDirError, match=r"rows \[0:48\] are not whole scale blocks of 32"):
        ranked(tmp_path / "b", tensor_parallel_size=2)
