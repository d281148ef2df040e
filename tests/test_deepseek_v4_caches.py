"""DeepSeek-V4's compressed caches through the compiler, the reference executor and the engine
(tests/specs/deepseek_v4_attention.yaml: one sliding, one CSA (m = 4, top-2 of the entries) and
one HCA (m = 8) layer over a plain residual; dummy weights). Pages of 4 tokens: a CSA entry a
page, an HCA entry every other page, so prefix hits, chunks and preemptions cut compression
blocks and pages at every phase. Each must give the logits of one cold one-shot run at every
position it computes, and the same greedy tokens.
"""
import json
from pathlib import Path

import numpy as np
import pytest

from infc.compiler.build import compile_model
from infc.compiler.contract import caches as C
from infc.runtime.engine.runner import CPURunner
from infc.runtime.engine.sampling import SamplingParams
from infc.runtime.weights.dummy import dummy_weights

from exhaustive import EXHAUSTIVE
from test_scheduler import assert_all_free, drain

SPEC = Path(__file__).resolve().parent / "specs" / "deepseek_v4_attention.yaml"
PAGE = 4
GREEDY = dict(temperature=0, ignore_eos=True)
CONFIG = dict(architectures=["DeepseekV4AttentionForTest"], vocab_size=96, hidden_size=32, num_hidden_layers=3,
              num_attention_heads=4, head_dim=16, q_lora_rank=24, qk_rope_head_dim=8, o_groups=2,
              o_lora_rank=8, index_n_heads=4, index_head_dim=8, index_topk=2, sliding_window=6,
              compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
              layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
              rope_theta=10000.0, compress_rope_theta=160000.0, rms_norm_eps=1e-6,
              rope_parameters={"compress": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 160000.0,
                                            "original_max_position_embeddings": 32, "beta_fast": 32,
                                            "beta_slow": 1, "attention_factor": 1.0}})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("dsv4-attn")
    (d / "config.json").write_text(json.dumps(CONFIG))
    _, plan = compile_model(model_dir=str(d), spec_path=str(SPEC), check_checkpoint=False)
    return plan, dummy_weights(plan, seed=5)


class AllRows(CPURunner):
    """Every row's logits by position (one sequence at a time), as the last step computed it."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.rows = {}

    def forward(self, meta):
        logits, blocks = self.executor.step_paged(meta, list(range(meta.T)))
        for at, block in blocks:
            for j, row in enumerate(block):
                self.rows[int(meta.positions[at + j])] = np.array(row)
        return logits


def _engine(tiny, caching=True, pages=64, budget=2048, snapshots=None):
    from infc.runtime.engine.engine import Engine
    plan, w = tiny
    runner = AllRows(plan, w, pages, PAGE, 4, snapshots)
    return Engine(runner, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=budget,
                  enable_prefix_caching=caching)


def _cold(tiny, prompt, params):
    e = _engine(tiny, caching=False)
    e.add_request(prompt, params, "cold")
    return drain(e)["cold"][0], dict(e.runner.rows)


def _same_logits(rows, cold_rows, first):
    assert min(rows) == first                            # nothing before the hit was computed
    for p, row in rows.items():
        assert np.abs(row - cold_rows[p]).max() <= 1e-4, p


def test_plan_declares_the_compressed_caches(tiny):
    decl = C.of_plan(tiny[0])
    assert decl["csa"] == {"kind": "paged", "every": 4, "shape": [16], "dtype": "bf16", "layers": [1]}
    assert decl["hca"]["every"] == 8 and decl["ikv"]["every"] == 4 and decl["ikv"]["shape"] == [8]
    assert decl["csa_buf"]["kind"] == "slot" and decl["csa_buf"]["shape"] == [8, 4 * 16]   # 2m rows of kv|gate
    assert decl["hca_buf"]["shape"] == [8, 2 * 16]                                       # m rows
    assert decl["swa"]["layers"] == [1, 2]


@pytest.mark.parametrize("budget", [pytest.param(2048, marks=EXHAUSTIVE), 7], ids=["one-shot", "chunked"])
def test_prefix_hit_and_chunks_equal_a_cold_one_shot_run(tiny, budget):
    """A 37-token prompt (past the window of 6, four HCA and nine CSA blocks): chunked; hit again
    (36 tokens from the cache: an HCA block half done, its partial block and the CSA overlap from
    the restored slot); a prompt sharing 30 tokens (a hit of 28, the snapshot pool's oldest):
    each gives the cold run's logits at every position it computes and its greedy tokens."""
    rng = np.random.default_rng(4)
    prompt = rng.integers(0, 96, 37).tolist()
    params = SamplingParams(max_tokens=16, **GREEDY)
    want, cold_rows = _cold(tiny, prompt, params)
    e = _engine(tiny, budget=budget)
    e.add_request(prompt, params, "a")
    assert drain(e)["a"][0] == want
    _same_logits(e.runner.rows, cold_rows, 0)
    e.runner.rows.clear()
    e.add_request(prompt, params, "b")
    assert drain(e)["b"][0] == want
    assert e.snapshots.restored == 1 and e.bm.hit_tokens == 36
    _same_logits(e.runner.rows, cold_rows, e.bm.hit_tokens)
    if budget == 7:
        other = prompt[:30] + rng.integers(0, 96, 9).tolist()
        want, cold_rows = _cold(tiny, other, params)
        e.runner.rows.clear()
        before = e.bm.hit_tokens
        e.add_request(other, params, "c")
        assert drain(e)["c"][0] == want
        assert e.bm.hit_tokens - before == 28
        _same_logits(e.runner.rows, cold_rows, 28)
    e.bm.check()


def test_outputs_under_preemption_and_prefix_caching_equal_without(tiny):
    """8 requests over 2 shared prefixes, 4 at a time in 16 pages (preemptions, recomputed), 3
    snapshots: outputs with prefix caching on equal those with it off."""
    rng = np.random.default_rng(9)
    stems = [rng.integers(0, 96, int(n)).tolist() for n in (13, 22)]
    prompts = [stems[i % 2] + rng.integers(0, 96, int(rng.integers(1, 6))).tolist() for i in range(8)]
    params = SamplingParams(max_tokens=6, **GREEDY)
    outs = []
    for caching in (False, True):
        e = _engine(tiny, caching=caching, pages=16, budget=16, snapshots=3)
        for i, p in enumerate(prompts):
            e.add_request(p, params, f"r{i}")
        got = drain(e)
        outs.append([got[f"r{i}"][0] for i in range(8)])
    assert outs[0] == outs[1]
    assert e.bm.hit_tokens > 0 and e.snapshots.restored > 0 and e.metrics.num_preemptions_total > 0
    assert_all_free(e)
