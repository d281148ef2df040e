"""DeepSeek-V2 under --tensor-parallel-size / --enable-expert-parallel (issue 13 item 3), on the
CPU with simulated ranks (runtime/reference/ranks.py), against the single-rank plan.

The tiny checkpoints of tests/test_deepseek_v2.py: 4 query heads, latent 32 + rope 8, a dense
layer then 2 MoE layers of 8 routed experts (top 3) and 2 shared experts;
  plain:  q_proj, greedy routing                       (V2-Lite's form)
  qlora:  q_a_proj -> norm -> q_b_proj, group-limited routing (4 groups, best 2), scale 2.5
TP splits MLA's query heads (q / q_b column-parallel, W_uk / W_uv per head, o_proj row-parallel +
all_reduce) and keeps kv_a, its norm and the whole latent cache on every rank; EP partitions the
routed experts after routing on the full router logits; the shared experts are TP-sharded under
TP and replicated under EP alone (vLLM's choice, compiler/passes/shard_ranks.py).
"""
import json

import numpy as np
import pytest

from infc.cli import main
from infc.compiler.build import compile_model
from infc.compiler.contract.errors import SpecError
from infc.compiler.build import compile_ranks
from infc.compiler.parallel import settings
from infc.compiler.contract import caches
from infc.compiler.contract.program import unrolled
from infc.runtime.reference.executor import ReferenceExecutor, SeqChunk
from infc.runtime.reference.ranks import RankExecutor, rank_runner
from infc.compiler.contract.safetensors_io import Checkpoint
from infc.runtime.weights.load import load_weights

from test_deepseek_v2 import BASE, VOCAB, models  # noqa: F401  (the module fixture)

TOL = 1e-4

CASES = [   # (variant, settings)
    ("plain", dict(expert_parallel_only=2)),                               # EP, attention replicated
    ("plain", dict(tensor_parallel_size=2)),
    ("plain", dict(tensor_parallel_size=2, enable_expert_parallel=True)),   # TP x EP
    ("plain", dict(tensor_parallel_size=4)),
    ("qlora", dict(expert_parallel_only=2)),
    ("qlora", dict(tensor_parallel_size=2)),
    ("qlora", dict(tensor_parallel_size=2, enable_expert_parallel=True)),
    ("qlora", dict(expert_parallel_only=4)),
    ("qlora", dict(tensor_parallel_size=4, enable_expert_parallel=True)),
]


def _id(case):
    kind, par = case
    return f"{kind}-" + "-".join(f"{k}{v}" for k, v in par.items())


_SINGLE = {}


def _single(d):
    if str(d) not in _SINGLE:
        _, plan = compile_model(model_dir=str(d))
        _SINGLE[str(d)] = (plan, load_weights(plan, Checkpoint(d)))
    return _SINGLE[str(d)]


def _ranks(d, **par):
    plans = [p for _, p in compile_ranks(settings(**par), model_dir=str(d))]
    return plans, [load_weights(p, Checkpoint(d)) for p in plans]


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_ranks_give_the_single_rank_logits(models, case, rng):
    kind, par = case
    d, _ = models[kind]
    one = ReferenceExecutor(*_single(d))
    plans, weights = _ranks(d, **par)
    many = RankExecutor(plans, weights)
    ids = [int(t) for t in rng.integers(0, VOCAB, 16)]
    # the whole prompt as 16 prefixes in one step (every position's logits), then one token a step
    chunks = [SeqChunk(k, ids[:k], 0) for k in range(1, len(ids) + 1)]
    assert np.abs(many.step(chunks) - one.step(chunks)).max() <= TOL
    worst = 0.0
    for pos, t in enumerate(ids):
        step = [SeqChunk(100, [t], pos)]
        worst = max(worst, float(np.abs(many.step(step) - one.step(step)).max()))
        for r in range(1, len(plans)):      # every rank holds the same logits, bit for bit
            assert np.array_equal(many.logits[r], many.logits[0])
    assert worst <= TOL, worst
    # a mixed step: one sequence decodes while another prefills
    a = [int(t) for t in rng.integers(0, VOCAB, 5)]
    step = [SeqChunk(100, [ids[0]], len(ids)), SeqChunk(101, a, 0)]
    assert np.abs(many.step(step) - one.step(step)).max() <= TOL


def test_unfused_ranks_and_the_build(models, tmp_path, capsys):
    """--no-fuse: the generic launches around the collectives give the same logits; `infc build`
    writes one plan per rank, the ranks sharing one kernels/ (same shapes on every rank)."""
    d, _ = models["qlora"]
    one = ReferenceExecutor(*_single(d))
    plans = [p for _, p in compile_ranks(settings(tensor_parallel_size=2, enable_expert_parallel=True),
                                         model_dir=str(d), fuse=False)]
    many = RankExecutor(plans, [load_weights(p, Checkpoint(d)) for p in plans])
    ids = list(range(3, 19))
    assert np.abs(many.step([SeqChunk(0, ids, 0)]) - one.step([SeqChunk(0, ids, 0)])).max() <= TOL
    rc = main(["build", "--model-path", str(d), "--no-compile", "--out", str(tmp_path / "o"),
               "--tensor-parallel-size", "2", "--enable-expert-parallel"])
    assert rc in (0, None), capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "o").glob("plan.rank*.json")) == ["plan.rank0.json", "plan.rank1.json"]


@pytest.mark.parametrize("kind", ["plain", "qlora"])
def test_rank_plans_split_heads_and_keep_the_latent_whole(models, kind):
    d, _ = models[kind]
    whole, _ = _single(d)
    W = whole["weights"]
    plans = [p for _, p in compile_ranks(settings(tensor_parallel_size=2), model_dir=str(d))]
    for r, p in enumerate(plans):
        w = p["weights"]
        # every rank keeps the whole latent cache: 32 + 8 values a token, as one rank
        assert caches.unit_elems(p["caches"]["latent"]) == caches.unit_elems(whole["caches"]["latent"]) == 40
        for name in ("w_uk", "w_uv"):                 # absorbed kv_b_proj: the rank's 2 of 4 heads
            assert w[name]["shape"] == [2] + W[name]["shape"][1:]
            src = w[name]["source"]
            assert src["axis"] == 0 and (src["start"], src["stop"]) == (2 * r, 2 * r + 2)
        assert w["wo"]["shape"] == [64, 2 * 12] and w["wo"]["source"]["axis"] == 1
        # kv_a (fused with q_a under q_lora) and the latent norm are replicated
        kv_a = "wq_a_wkv_a" if kind == "qlora" else next(n for n in w if "wkv_a" in n)
        assert w["kv_norm"] == W["kv_norm"]
        if kind == "qlora":
            assert w[kv_a] == W[kv_a] and w["q_a_norm"] == W["q_a_norm"]
        assert w["embed"] == W["embed"] and w["lm_head"] == W["lm_head"]
        assert w["ws_down"]["shape"] == [64, 24]        # shared experts F/2 under TP (vLLM)
        ops = [l["op"] for l, _ in unrolled(p["programs"]["decode"])]
        # one all_reduce per sublayer: attention, and the MLP (the MoE layers' shared + routed
        # partial sums are added, then reduced once)
        assert ops.count("all_reduce") == 2 * 3 and "ep_dispatch" not in ops


def test_expert_parallel_alone_keeps_attention_and_shared_experts_whole(models):
    d, _ = models["qlora"]
    whole, _ = _single(d)
    plans = [p for _, p in compile_ranks(settings(expert_parallel_only=4), model_dir=str(d))]
    for r, p in enumerate(plans):
        w = p["weights"]
        for name in ("w_uk", "w_uv", "wo", "kv_norm"):
            assert w[name] == whole["weights"][name], name
        # the whole plan folds the shared experts into its expert stacks (fold_shared_experts);
        # after an EP dispatch they stay a dense MLP, whole on every rank, read as the whole
        # plan's stack reads them
        assert w["ws_down"]["shape"] == [BASE["hidden_size"], BASE["n_shared_experts"] * BASE["moe_intermediate_size"]]
        assert "ws_down" not in whole["weights"]
        assert json.dumps(w["ws_down"]["source"]) in json.dumps(whole["weights"]["wes_down"]["source"])
        down = w["we_down"]
        assert down["shape"][0] == 2 and (down["source"]["start"], down["source"]["stop"]) == (2 * r, 2 * r + 2)
        ops = [l["op"] for l, _ in unrolled(p["programs"]["decode"])]
        assert "all_reduce" not in ops and ops.count("ep_dispatch") == ops.count("ep_combine") == 2
        # routing (group-limited top-k over all 8 experts) runs before the dispatch, on every rank
        route = next(l for l, _ in unrolled(p["programs"]["decode"]) if l["op"].startswith("moe_route"))
        assert route["attrs"]["groups"] == 4 and route["attrs"]["topk_groups"] == 2
        assert ops.index(route["op"]) < ops.index("ep_dispatch")


def test_engine_on_simulated_ranks_generates_the_single_rank_tokens(models, rng):
    """The engine (paged latent cache, batching) over TP x EP ranks of the group-limited q_lora
    model: rank 0's step metadata serves every rank, rank 0 samples."""
    from families import engine_greedy
    from infc.runtime.engine.runner import CPURunner
    d, _ = models["qlora"]
    runners = [CPURunner(*_single(d), 32),
               rank_runner(*_ranks(d, tensor_parallel_size=2, enable_expert_parallel=True), 32)]
    prompts = [[int(t) for t in rng.integers(0, VOCAB, n)] for n in (11, 4, 19)]
    outs = [engine_greedy(runner, prompts, 8) for runner in runners]
    assert outs[0] == outs[1] and all(len(t) == 8 for t in outs[0].values())
    assert len({tuple(t) for t in outs[0].values()}) == 3          # three different continuations


# -- malformed settings: a clear message naming the setting and the numbers ---------------------

def test_tp_that_does_not_divide_the_heads_exits_2(models, tmp_path, capsys):
    d, _ = models["plain"]
    rc = main(["build", "--model-path", str(d), "--no-compile", "--out", str(tmp_path / "o"),
               "--tensor-parallel-size", "3"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err, err
    assert "--tensor-parallel-size 3 does not divide the 4 query heads of this latent attention" in err


def test_ep_that_does_not_divide_the_routed_experts(models, tmp_path, capsys):
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM
    with pytest.raises(SpecError, match=r"--enable-expert-parallel over 3 ranks: 8 experts are not divisible by 3"):
        compile_ranks(settings(expert_parallel_only=3), model_dir=str(models["plain"][0]))
    # through the CLI: 6 heads divide over 3 ranks, 8 routed experts do not
    six = tmp_path / "six"
    DeepseekV2ForCausalLM(DeepseekV2Config(**{**BASE, "hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 6,
                                              "num_hidden_layers": 2})).save_pretrained(six)
    rc = main(["build", "--model-path", str(six), "--no-compile", "--out", str(tmp_path / "o"),
               "--tensor-parallel-size", "3", "--enable-expert-parallel"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err, err
    assert "8 experts are not divisible by 3" in err
    rc = main(["build", "--model-path", str(six), "--no-compile", "--out", str(tmp_path / "o3"),
               "--tensor-parallel-size", "3"])                  # TP alone: experts split F/3
    assert rc == 0, capsys.readouterr().err


def test_mla_is_never_replicated_silently(models, tmp_path):
    """A query that mixes the heads before the latent attention (a norm over all of q_pe at once)
    cannot be split: the build says so rather than running the attention whole on every rank."""
    from pathlib import Path
    spec = (Path(__file__).resolve().parent.parent / "specs" / "deepseek_v2.yaml").read_text()
    # Hq * Dr = 32 = Dc in the tiny config: kv_norm fits the flat q_pe
    bad = spec.replace("- qp = linear(h, wq_pe)", "- qp = rms_norm(linear(h, wq_pe), kv_norm, 1.0e-6)")
    assert bad != spec
    (tmp_path / "deepseek_v2.yaml").write_text(bad)
    d, _ = models["plain"]
    compile_model(model_dir=str(d), spec_path=str(tmp_path / "deepseek_v2.yaml"))    # fine alone
    with pytest.raises(SpecError, match="rms_norm works across the whole feature axis"):
        compile_ranks(settings(tensor_parallel_size=2), model_dir=str(d),
                      spec_path=str(tmp_path / "deepseek_v2.yaml"))


def test_inspect_shows_the_ranks_collectives(capsys):
    """`infc inspect deepseek-v2-lite --tensor-parallel-size 2 --rank 1`: the published shapes,
    rank 1 alone; one all_reduce per sublayer of the 27 layers."""
    rc = main(["inspect", "deepseek-v2-lite", "--tensor-parallel-size", "2", "--rank", "1",
               "--phase", "decode"])
    out = capsys.readouterr().out
    assert rc in (0, None)
    assert "rank 1 of 2 (tp 2, ep 1)" in out and "rank 0 of 2" not in out
    coll = out.split("== collectives")[1].split("==")[0]
    assert "decode: 54 per step" in coll                     # 27 attention + 27 MLP / MoE
    assert "ep_dispatch" not in coll
    assert "heads of ['w_uk', 'w_uv']" in out                # the absorbed per-head weights split
    rc = main(["inspect", "deepseek-v2-lite", "--tensor-parallel-size", "2", "--enable-expert-parallel",
               "--rank", "0", "--phase", "decode"])
    coll = capsys.readouterr().out.split("== collectives")[1].split("==")[0]
    assert "ep_dispatch" in coll and "ep_combine" in coll and "decode: 106 per step" in coll
