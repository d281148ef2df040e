"""DeepSeek-V4 under --tensor-parallel-size [--enable-expert-parallel] (issue 47 item 5), on the
CPU with simulated ranks (runtime/reference/ranks.py), against the single-rank plan.

The tiny float32 checkpoint of tests/test_deepseek_v4.py ("m16": 4 query heads of 16, 2 output
groups, 4 layers: sliding, CSA (indexer top-4 of m = 4 entries), HCA (m = 16), CSA; hash-routed
and score-routed MoE of 4 experts, mHC over 2 streams), window 8. TP splits the query heads with
their sinks (wq_b column-parallel; the grouped output projection one group a rank: wo_a by group,
wo_b row-parallel + all_reduce); the shared K = V head (wkv and its norm), the compressors and
their caches and the lightning indexer stay whole on every rank (compiler/passes/shard_rules.py
says why). The prompt of 37 tokens crosses the window, nine CSA blocks and two HCA blocks; the
engine over the ranks (rank_runner) batches three sequences, each with its own state slot.
"""
import re

import numpy as np
import pytest

from infc.cli import main
from infc.compiler.build import compile_model, compile_ranks
from infc.compiler.contract import caches
from infc.compiler.contract.program import unrolled
from infc.compiler.contract.safetensors_io import Checkpoint
from infc.compiler.ir import Node
from infc.compiler.parallel import settings
from infc.compiler.passes.shard_rules import rule
from infc.runtime.reference.executor import ReferenceExecutor, SeqChunk
from infc.runtime.reference.ranks import RankExecutor
from infc.runtime.weights.load import load_weights

from exhaustive import EXHAUSTIVE
from test_deepseek_v4 import CONFIG, VOCAB, _randomize

TOL = 1e-4
TP2 = dict(tensor_parallel_size=2)
TP2_EP2 = dict(tensor_parallel_size=2, enable_expert_parallel=True)


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    import torch
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
    torch.manual_seed(47)
    cfg = dict(CONFIG, sliding_window=8,
               compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16})
    hf = DeepseekV4ForCausalLM(DeepseekV4Config(**cfg)).float().eval()
    _randomize(hf)
    d = tmp_path_factory.mktemp("deepseek_v4_tp")
    hf.save_pretrained(d)
    return d


_PLANS = {}


def _plans(d, **par):
    """The single-rank plan (par {}) or the rank plans, compiled once a module."""
    key = (str(d), tuple(sorted(par.items())))
    if key not in _PLANS:
        _PLANS[key] = ([compile_model(model_dir=str(d))[1]] if not par else
                       [p for _, p in compile_ranks(settings(**par), model_dir=str(d))])
    return _PLANS[key]


def _executors(d, par):
    (whole,) = _plans(d)
    plans = _plans(d, **par)
    return (ReferenceExecutor(whole, load_weights(whole, Checkpoint(d))),
            RankExecutor(plans, [load_weights(p, Checkpoint(d)) for p in plans]))


def _diff(many, one, chunks):
    return float(np.abs(many.step(chunks) - one.step(chunks)).max())


@pytest.mark.parametrize("par", [TP2, TP2_EP2], ids=["tp2", "tp2-ep2"])
def test_ranks_give_the_single_rank_logits(v4, par):
    one, many = _executors(v4, par)
    ids = [int(t) for t in np.random.default_rng(5).integers(0, VOCAB, 37)]
    assert _diff(many, one, [SeqChunk(0, ids, 0)]) <= TOL
    worst = 0.0
    for k, t in enumerate(ids[:4]):                       # decode steps past the prompt
        worst = max(worst, _diff(many, one, [SeqChunk(0, [t], len(ids) + k)]))
        assert np.array_equal(many.logits[1], many.logits[0])      # the all_reduce: same bits
    assert worst <= TOL, worst
    # a mixed step: the sequence decodes while a new one prefills past a CSA block
    step = [SeqChunk(0, [ids[5]], len(ids) + 4), SeqChunk(1, ids[10:19], 0)]
    assert _diff(many, one, step) <= TOL


def test_engine_on_simulated_ranks_gives_the_single_rank_logits(v4):
    """The engine over TP 2 ranks (rank_runner): three sequences batched, each with its own state
    slot for its partial compression blocks (sharing one slot, the ranks were 3e-3 off); every
    step's logits are the single-rank CPURunner's. Prefix caching off in both: the rank runner
    keeps no state snapshots, so with it on the two engines would schedule differently."""
    from families import engine_tokens
    from infc.runtime.engine.runner import CPURunner
    from infc.runtime.engine.sampling import SamplingParams
    from infc.runtime.reference.ranks import rank_runner
    (whole,) = _plans(v4)
    plans = _plans(v4, **TP2)
    runners = [CPURunner(whole, load_weights(whole, Checkpoint(v4)), 64, page_size=16),
               rank_runner(plans, [load_weights(p, Checkpoint(v4)) for p in plans], 64, page_size=16)]
    rows = [[], []]
    for runner, out in zip(runners, rows):
        forward = runner.forward
        runner.forward = lambda meta, f=forward, out=out: out.append(np.array(f(meta))) or out[-1]
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(0, VOCAB, n)] for n in (11, 4, 19)]
    params = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)] * 3
    toks = [engine_tokens(r, prompts, params, max_model_len=256, enable_prefix_caching=False) for r in runners]
    assert toks[0] == toks[1] and len(rows[0]) == len(rows[1]) > 3
    assert max(float(np.abs(a - b).max()) for a, b in zip(*rows)) <= TOL


def test_rank_plans_split_the_query_heads_and_keep_the_shared_kv_whole(v4):
    (whole,) = _plans(v4)
    W = whole["weights"]
    for r, p in enumerate(_plans(v4, **TP2)):
        w = p["weights"]
        src = {n: w[n]["source"] for n in ("wq_b", "sinks", "wo_a", "wo_b")}
        assert w["wq_b"]["shape"] == [2 * 16, 24] and src["wq_b"]["axis"] == 0
        assert (src["wq_b"]["start"], src["wq_b"]["stop"]) == (32 * r, 32 * r + 32)
        assert w["sinks"]["shape"] == [2] and (src["sinks"]["start"], src["sinks"]["stop"]) == (2 * r, 2 * r + 2)
        assert w["wo_a"]["shape"] == [1, 8, 32] and (src["wo_a"]["axis"], src["wo_a"]["start"]) == (0, r)
        assert w["wo_b"]["shape"] == [32, 8] and (src["wo_b"]["axis"], src["wo_b"]["start"]) == (1, 8 * r)
        # shared by every head: the K = V head (fused with wq_a), the compressors, the indexer
        for name in ("wq_a_wkv", "kv_norm", "cs_ape", "cs_norm", "ch_kv_gate", "ch_norm", "i_q", "i_ape",
                     "i_norm", "i_w_i_kv_i_gate_cs_kv_cs_gate", "embed", "lm_head", "hc_attn_fn"):
            assert w[name] == W[name], name
        # so every rank keeps every cache whole, as one rank does
        assert p["caches"].keys() == whole["caches"].keys() >= {"swa", "csa", "csa_buf", "hca", "ikv", "k"}
        for name, decl in p["caches"].items():
            assert caches.unit_elems(decl) == caches.unit_elems(whole["caches"][name]), name
        launches = [l for l, _ in unrolled(p["programs"]["decode"])]
        assert [l["attrs"]["kv_heads"] for l in launches if l["op"] == "attention_cached"] == [1]
        # one all_reduce a sublayer: the attention, the MoE (shared + routed partial sums added)
        assert [l["op"] for l in launches].count("all_reduce") == 2 * 4


def test_tp_and_ep_ranks_hold_their_experts(v4):
    for r, p in enumerate(_plans(v4, **TP2_EP2)):
        down = p["weights"]["we_down"]
        assert down["shape"][0] == 2 and (down["source"]["start"], down["source"]["stop"]) == (2 * r, 2 * r + 2)
        ops = [l["op"] for l, _ in unrolled(p["programs"]["decode"])]
        assert ops.count("ep_dispatch") == ops.count("ep_combine") == 4 and ops.count("all_reduce") == 2 * 4


# -- the rules, one by one ---------------------------------------------------------------------

def _node(op, n_inputs, **attrs):
    return Node("n", op, [f"x{i}" for i in range(n_inputs)], ["y"], attrs, 1, fused_from=[])


def test_rope_tail_rule_is_per_head():
    r = rule("rope_tail")
    assert r.per_head and r.walked(_node("rope_tail", 1)) == [0] and not r.attention


def test_attention_cached_walks_the_query_alone_over_one_kv_head():
    r = rule("attention_cached")
    assert r.walked(_node("attention_cached", 3, kv_heads=1, has_sinks=True)) == [0]
    assert r.walked(_node("attention_cached", 2, kv_heads=2)) == [0, 1]         # k / v carry heads
    assert r.cut(_node("attention_cached", 3, kv_heads=1, has_sinks=True)) == {2: 0}
    assert r.cut(_node("attention_cached", 2, kv_heads=4)) == {}


def test_compressed_attention_splits_the_query_and_its_sinks():
    r = rule("compressed_attention_cached")              # split_compression's reader (q, marker, sinks, index)
    node = _node("compressed_attention_cached", 4, has_index=True)
    assert r.attention and r.walked(node) == [0] and r.cut(node) == {2: 0}


def test_tp_that_does_not_divide_the_output_groups_exits_2(v4, tmp_path, capsys):
    """TP 4: one query head a rank, but the 2 output groups cannot be cut into 4."""
    rc = main(["build", "--model-path", str(v4), "--no-compile", "--out", str(tmp_path / "o"),
               "--tensor-parallel-size", "4"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err, err
    assert "--tensor-parallel-size 4: the heads of head_linear's weight at line" in err
    assert "2 is not divisible by 4 ranks (weight 'wo_a' bf16[2, 8, 32])" in err


# -- the full size --------------------------------------------------------------------------------

def test_inspect_flash_at_tp8_ep8_reports_the_rank_memory(capsys, monkeypatch):
    """`infc inspect deepseek-v4-flash --tensor-parallel-size 8 --enable-expert-parallel`: a rank's
    weights are its eighth of the heads and experts, its cache per 128k sequence the single
    rank's (the shared K = V head and the compressed caches stay whole); one all_reduce per
    sublayer and an expert dispatch / combine per MoE layer. The kernels are not rendered here
    (847 templates, 9 s; the EXHAUSTIVE case below renders them)."""
    import infc.compiler.build as build
    monkeypatch.setattr(build, "generate", lambda plan, out: None)
    assert main(["inspect", "deepseek-v4-flash", "--tensor-parallel-size", "8", "--enable-expert-parallel",
                 "--rank", "3", "--phase", "decode"]) in (0, None)
    _check_flash_rank(capsys.readouterr().out, "3")


def _check_flash_rank(out, rank):
    assert f"rank {rank} of 8 (tp 8, ep 8)" in out
    h200 = re.search(r"H200 \([\d.]+ GiB\): weights ([\d.]+) GiB \+ arena ([\d.]+) GiB .* \+ ([\d.]+) GiB a "
                     r"sequence: (\d+) sequences fit", out)
    assert h200, out.split("== memory per GPU")[1][:600]
    weights, cache = float(h200[1]), float(h200[3])
    one = compile_model("deepseek-v4-flash")[1]
    from infc.compiler.memory_budget import budget, GPU_MIB, GIB
    whole = budget(one, 131072, GPU_MIB["H200"])
    # the routed experts (~98 % of the bytes) and the attention heads split 8 ways; the
    # replicated rest (embedding, lm_head, kv head, compressors, indexer, routers) stays whole
    assert whole["weights"] / GIB / 8 < weights < whole["weights"] / GIB / 7
    assert cache == round(whole["cache_per_seq"] / GIB, 3)
    assert int(h200[4]) >= 1
    coll = out.split("== collectives")[1].split("==")[0]
    assert "decode: 172 per step" in coll            # 43 x (attention, shared experts, dispatch, combine)


@EXHAUSTIVE
def test_inspect_flash_at_tp8_ep8_through_the_cli(capsys):
    assert main(["inspect", "deepseek-v4-flash", "--tensor-parallel-size", "8", "--enable-expert-parallel",
                 "--rank", "0", "--phase", "decode"]) in (0, None)
    out = capsys.readouterr().out
    assert "kernels: not rendered" not in out
    _check_flash_rank(out, "0")


# -- one kv head and sinks outside DeepSeek-V4 ----------------------------------------------------

@EXHAUSTIVE
@pytest.mark.parametrize("fam,over,par", [("qwen3", {"num_key_value_heads": 1}, TP2),
                                          ("gpt_oss", None, TP2_EP2)], ids=["qwen3-mqa-tp2", "gpt_oss-tp2-ep2"])
def test_one_kv_head_and_sinks_elsewhere(fam, over, par, tiny_model, family_model, rng):
    """Multi-query attention (one kv head, whole on each rank) and GPT-OSS's sinks (cut to the
    rank's heads) in the standard attention_cached, through the same rules."""
    d = tiny_model(fam, **over)[0] if over is not None else family_model(fam)[0]
    _, whole = compile_model(model_dir=str(d))
    plans = [p for _, p in compile_ranks(settings(**par), model_dir=str(d))]
    one = ReferenceExecutor(whole, load_weights(whole, Checkpoint(d)))
    many = RankExecutor(plans, [load_weights(p, Checkpoint(d)) for p in plans])
    ids = [int(t) for t in rng.integers(0, 320, 12)]
    assert _diff(many, one, [SeqChunk(0, ids, 0)]) <= TOL
    assert max(_diff(many, one, [SeqChunk(0, [t], len(ids) + k)]) for k, t in enumerate(ids[:3])) <= TOL
    if over:
        assert caches.unit_elems(plans[1]["caches"]["k"]) == caches.unit_elems(whole["caches"]["k"])
    else:
        assert plans[1]["weights"]["sinks"]["shape"] == [whole["weights"]["sinks"]["shape"][0] // 2]
