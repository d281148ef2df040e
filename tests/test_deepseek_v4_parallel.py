"""DeepSeek-V4 over simulated ranks on the CPU (issue 47, Scale): attention data-parallel with
expert parallelism (--data-parallel-size 2 --enable-expert-parallel: each rank its own sequences,
its own sliding-window, compressed and indexer caches and partial-block slots; the routed experts
split 2 a rank, the hash table and the score router run on every rank before the dispatch), against
the single-rank plan: every rank's logits for its own sequences within 1e-4 (float32). The model is
tests/test_deepseek_v4.py's "m16" (4 layers: sliding, CSA, HCA, CSA; hash and score-routed MoE;
mHC with 2 streams), prompts over several HCA blocks of 16 and past the window of 8, the ranks'
steps of different lengths and phases (a rank idle, a prefill beside decodes). Tensor parallelism
is another change's (compiler/passes/shard_rules.py)."""
import numpy as np
import pytest
import torch

from infc.runtime.reference.executor import SeqChunk

from test_data_parallel import _check
from test_deepseek_v4 import CONFIG, SIZES, VOCAB, _randomize
from test_parallel import ranked, single

TOL = 1e-4


@pytest.fixture(scope="module")
def m16(tmp_path_factory):
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
    size = SIZES["m16"]
    torch.manual_seed(47)
    cfg = dict(CONFIG, sliding_window=size["window"],
               compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": size["hca"]})
    hf = DeepseekV4ForCausalLM(DeepseekV4Config(**cfg)).float().eval()
    _randomize(hf)
    d = tmp_path_factory.mktemp("deepseek_v4_dp")
    hf.save_pretrained(d)
    return d


def test_data_parallel_expert_parallel_ranks_give_the_single_rank_logits(m16):
    one, (many, plans) = single(m16), ranked(m16, data_parallel_size=2, enable_expert_parallel=True)
    assert [p["parallel"] for p in plans] == [{"world": 2, "rank": r, "tp": 1, "ep": 2, "dp": 2} for r in range(2)]
    for p in plans:                  # 2 of the 4 routed experts a rank; the caches every layer's
        assert p["weights"]["we_down"]["shape"][0] == 2, p["weights"]["we_down"]["shape"]
        assert {"csa", "ikv", "hca", "swa"} <= set(p["caches"])
    rng = np.random.default_rng(5)
    prompts = {0: [int(t) for t in rng.integers(0, VOCAB, 35)], 1: [int(t) for t in rng.integers(0, VOCAB, 18)]}
    worst = _check(many, one, [[SeqChunk(r, prompts[r], 0)] for r in range(2)])
    at = {r: len(p) for r, p in prompts.items()}
    for step in range(4):
        per_rank = [[SeqChunk(r, [int(rng.integers(0, VOCAB))], at[r])] for r in range(2)]
        if step == 1:                # rank 1 idle: pad rows only
            per_rank[1] = []
        if step == 2:                # rank 0 starts a prompt beside its decode
            per_rank[0].append(SeqChunk(7, [int(t) for t in rng.integers(0, VOCAB, 9)], 0))
        worst = max(worst, _check(many, one, per_rank))
        for r in range(2):
            if per_rank[r]:
                at[r] += 1
    assert worst <= TOL, worst
