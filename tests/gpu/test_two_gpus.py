"""Two GPUs, one process per GPU over NCCL (issue 14): the rank plans of a parallel build run by
rank 0's MultiProcessRunner (runtime/distributed/rank_workers.py: rank 0 here on GPU 0 with the steps, rank 1
spawned on GPU 1, each a CudaRunner whose collectives run on its stream and are captured in its
decode graphs: small all-reduces one-shot over the peers' mapped memory (runtime/cuda/p2p.py,
INFC_P2P=0 for NCCL alone), the rest NCCL calls), held to HF transformers in bf16 on GPU 0 by the golden gate of
test_golden.py (argmax regret <= 0.2 nat, top-8 |delta logprob| mean <= 0.06, p99 <= 0.2):

  qwen3-4b            --tensor-parallel-size 2 (heads and linears split, an all-reduce a sublayer)
  qwen3-30b-a3b-l4    --tensor-parallel-size 2 --enable-expert-parallel: the 4-layer cut at real
                      shapes (128 experts, top-8), attention split, 64 whole experts a rank
  deepseek-v2-lite-l8 --tensor-parallel-size 2 --enable-expert-parallel: the 8-layer cut (MLA's
                      q heads and W_uk / W_uv split, the latent cache whole on each rank, 32 routed
                      experts a rank, the shared experts split)

in eager batch 1 and across graph buckets (batches of 9 and 5), decode bit-identical over two runs,
and a rank killed in the middle of a decode stream: an error naming the rank within seconds
(the watchdog aborts rank 0's collectives: a waiting one-shot all-reduce is let go, NCCL's
communicator aborted), not a hang.

Needs two GPUs and `python tests/gpu/prepare.py twogpu` on the build machine (artifacts with
cubins; session.sh's `twogpu` stage runs this file). Skipped with fewer than two GPUs.
"""
import os
import threading
import time
from contextlib import closing
from pathlib import Path

import numpy as np
import pytest
import torch

import gpu_families
import models
import prepare
from test_golden import DECODE, LENS, gate, hf_logits, run


def gpu_count() -> int:
    return len(list(Path("/proc/driver/nvidia/gpus").glob("*")))


pytestmark = pytest.mark.skipif(gpu_count() < 2, reason="needs two GPUs")

FACTORY = "infc.runtime.distributed.rank_runners:nccl_rank_runner"
KW = dict(max_num_batched_tokens=16384, max_num_seqs=16, buckets=[1, 2, 4, 8, 16], num_pages=2048)


def _ranks_model(name):
    import test_ranks_gpu
    return test_ranks_gpu.model_dir(name)


def _family_model(name):
    out = models.MODELS / name
    if not ((out / "config.json").exists() and any(out.glob("*.safetensors"))):
        gpu_families.make_model(name, out)
    return out


# case -> (model directory maker, artifact (prepare.TWOGPU), extra prompt lengths)
CASES = {
    "qwen3-4b-tp2": (lambda: models.model_dir("qwen3-4b"), prepare.twogpu_artifact("qwen3-4b-tp2"), []),
    "qwen3-30b-a3b-l4-tp2-ep2": (lambda: _ranks_model("qwen3-30b-a3b-l4"),
                                 prepare.twogpu_artifact("ranks-qwen3-30b-a3b-l4-tp2-ep2"), []),
    "deepseek-v2-lite-l8-tp2-ep2": (lambda: _family_model("deepseek-v2-lite-l8"),
                                    prepare.twogpu_artifact("deepseek-v2-lite-l8-tp2-ep2"),
                                    gpu_families.LONG_PROMPTS["deepseek-v2-lite-l8"]),
}


def ranks(art, d, **kw):
    from infc.runtime.distributed.rank_workers import MultiProcessRunner
    if not (art / "bin").is_dir():
        pytest.fail(f"{art}/bin missing: run `python tests/gpu/prepare.py twogpu` and carry .cache",
                    pytrace=False)
    return MultiProcessRunner(FACTORY, {"artifact": str(art), "model_dir": str(d), **KW, **kw}, 2,
                              step_timeout=120)


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    from transformers import AutoModelForCausalLM
    make, art, extra = CASES[request.param]
    d = make()
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).to("cuda:0").eval()
    V = hf.config.vocab_size
    rng = np.random.default_rng(0)
    seqs = [[int(t) for t in rng.integers(0, V, n + DECODE)] for n in LENS + extra]
    want = hf_logits(hf, seqs, "cuda:0")
    del hf
    torch.cuda.empty_cache()
    yield request.param, d, art, seqs, want


def _gate(name, mode, got, want) -> list:
    """The golden gate's bounds; [] when they hold, else what missed (printed either way)."""
    worst = [gate(g, w) for g, w in zip(got, want)]
    regret, mean, p99 = max(w[0] for w in worst), float(np.mean([w[1] for w in worst])), max(w[2] for w in worst)
    print(f"[two-gpu] {name} {mode}: regret {regret:.3f} mean {mean:.4f} p99 {p99:.3f}", flush=True)
    return [] if regret <= 0.2 and mean <= 0.06 and p99 <= 0.2 else [(name, mode, regret, mean, p99)]


def test_golden_eager_batch_1(case):
    name, d, art, seqs, want = case
    with closing(ranks(art, d, cuda_graphs=False)) as r:
        assert not r.runner.graphs
        assert not _gate(name, "eager-b1", run(r, seqs, 1), want)


def test_golden_graph_buckets_and_bit_identical_decode(case):
    """Batches of 9 and 5 straddle the 8 and 16 buckets (their decode steps replay the graphs,
    collectives inside); the batch-9 run twice gives the same bits at every step. Every check
    runs before the test fails on any."""
    name, d, art, seqs, want = case
    with closing(ranks(art, d, cuda_graphs=True)) as r:
        assert r.runner.graphs and r.num_pages == KW["num_pages"]
        missed = _gate(name, "graph-b9", run(r, seqs, 9), want)
        missed += _gate(name, "graph-b5", run(r, seqs, 5), want)
        a, b = run(r, seqs[:9], 9), run(r, seqs[:9], 9)
        same = all(np.array_equal(x, y) for x, y in zip(a, b))
        print(f"[two-gpu] {name} decode bit-identical across two runs: {same}", flush=True)
    assert same, f"{name}: two identical runs differ"
    assert not missed, missed


def test_a_rank_killed_mid_stream_is_a_clear_error():
    """Rank 1 killed while rank 0 decodes in graphs (its all-reduces would wait for rank 1
    forever): RankError naming rank 1 within seconds, and rank 0's runner refuses further steps."""
    from infc.runtime.distributed.rank_workers import RankError
    from infc.runtime.engine.step import Chunk
    from driver_loop import Pages, step
    make, art, _ = CASES["qwen3-4b-tp2"]
    d = make()
    r = ranks(art, d, cuda_graphs=True)
    try:
        pages = Pages(r.num_pages, r.page_size)
        prompt = list(range(100, 164))
        tok = int(step(r, pages, [Chunk(0, prompt, 0)]).argmax())
        worker = r.procs[1]
        threading.Timer(0.5, worker.kill).start()
        t0 = time.monotonic()
        with pytest.raises(RankError, match=r"rank 1 \(pid \d+\) died"):
            for i in range(100000):
                tok = int(step(r, pages, [Chunk(0, [tok], len(prompt) + i)]).argmax())
                assert time.monotonic() - t0 < 60, "still stepping a minute after rank 1 was killed"
        took = time.monotonic() - t0
        print(f"[two-gpu] rank 1 killed 0.5 s into a decode stream: RankError after {took:.2f} s", flush=True)
        assert took < 20
        with pytest.raises(RankError, match="the ranks are down"):
            step(r, pages, [Chunk(0, [tok], 10_000)])
    finally:
        r.close()
    assert os.environ.get("NCCL_NVLS_ENABLE") == "0", "NVLink multicast must stay off here"


def run_data_parallel(runner, seqs, batch: int) -> list:
    """run()'s steps over data-parallel ranks: sequences alternate between the two ranks, each
    rank prefills its `batch` of a group then decodes them forced, every step padded alike
    (runtime/engine/step.py pad_ranks). Each row samples greedily with its top-8 logprobs, which is what
    the gate reads: -> per sequence, per position, [(token, logprob)] best first."""
    from driver_loop import Pages, rank_steps
    from infc.runtime.engine.runner import RowSampling
    from infc.runtime.engine.sampling import SamplingParams
    from infc.runtime.engine.step import Chunk
    pages = [Pages(runner.num_pages, runner.page_size) for _ in range(2)]
    row = RowSampling(SamplingParams(temperature=0, logprobs=8), seed=0, step=0)
    got = [[] for _ in seqs]

    def step(per_rank):
        metas = rank_steps(pages, per_rank, runner.num_pages)
        rows = [[row] * len(cs) + [None] * (m.B - len(cs)) for cs, m in zip(per_rank, metas)]
        for cs, samples in zip(per_rank, runner.execute_ranks(metas, rows)):
            for c, s in zip(cs, samples):
                got[c.seq_id].append(s.top)

    for g in range(0, len(seqs), 2 * batch):
        idx = list(range(g, min(g + 2 * batch, len(seqs))))
        mine = [idx[0::2], idx[1::2]]
        prompts = {i: seqs[i][: len(seqs[i]) - DECODE] for i in idx}
        step([[Chunk(i, prompts[i], 0) for i in m] for m in mine])
        for t in range(DECODE - 1):
            step([[Chunk(i, [seqs[i][len(prompts[i]) + t]], len(prompts[i]) + t) for i in m] for m in mine])
        for r, m in enumerate(mine):
            for i in m:
                pages[r].release(i)
    return got


def _gate_top(name, mode, got, want) -> list:
    """The golden gate from each row's top-8 (token, logprob): regret of the top token under
    HF's logprobs, |delta logprob| over those 8 tokens."""
    from test_golden import logprobs
    regrets, deltas = [], []
    for tops, w in zip(got, want):
        lt = logprobs(w)
        for top, ref in zip(tops, lt):
            toks = [t for t, _ in top]
            regrets.append(float(ref.max() - ref[toks[0]]))
            deltas += [abs(lp - ref[t]) for t, lp in top]
    regret, mean, p99 = max(regrets), float(np.mean(deltas)), float(np.quantile(deltas, 0.99))
    print(f"[two-gpu] {name} {mode}: regret {regret:.3f} mean {mean:.4f} p99 {p99:.3f}", flush=True)
    return [] if regret <= 0.2 and mean <= 0.06 and p99 <= 0.2 else [(name, mode, regret, mean, p99)]


def test_data_parallel_ranks_pass_the_golden_gate():
    """Attention data-parallel ranks with EP over two GPUs (--data-parallel-size 2
    --enable-expert-parallel): the qwen3-30b-a3b 4-layer cut at real shapes, each rank its own
    sequences, the experts over both ranks' rows by NCCL (all-gathers, reduce-scatter), the
    decode steps in CUDA Graphs; against HF bf16 on GPU 0, in batches of 1 and 5 a rank."""
    from transformers import AutoModelForCausalLM
    make, _, _ = CASES["qwen3-30b-a3b-l4-tp2-ep2"]
    d = make()
    art = prepare.twogpu_artifact("ranks-qwen3-30b-a3b-l4-dp2-ep2")
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).to("cuda:0").eval()
    rng = np.random.default_rng(0)
    seqs = [[int(t) for t in rng.integers(0, hf.config.vocab_size, n + DECODE)] for n in LENS]
    want = hf_logits(hf, seqs, "cuda:0")
    del hf
    torch.cuda.empty_cache()
    with closing(ranks(art, d, cuda_graphs=True)) as r:
        assert r.dp_world == 2 and r.runner.graphs
        missed = _gate_top("qwen3-30b-a3b-l4-dp2-ep2", "b1", run_data_parallel(r, seqs, 1), want)
        missed += _gate_top("qwen3-30b-a3b-l4-dp2-ep2", "b5", run_data_parallel(r, seqs, 5), want)
    assert not missed, missed


@pytest.mark.parametrize("name", ["qwen3-4b-tp2", "qwen3-30b-a3b-l4-tp2-ep2"])
def test_overlapped_steps_over_two_gpus_give_the_synchronous_tokens(name, monkeypatch):
    """Overlapped steps over ranks (the default): the engine launches step N + 1 before it reads
    step N; each rank samples every row itself (the ranks' logits must be the same bits) and feeds the pending
    tokens on its own GPU. Greedy and seeded sampling over the same ranks give the tokens of
    synchronous steps; a rank whose logits differed would diverge and fail this."""
    from families import engine_tokens
    from infc.runtime.engine.sampling import SamplingParams
    make, art, _ = CASES[name]
    d = make()
    rng = np.random.default_rng(4)
    prompts = [[int(t) for t in rng.integers(0, 30000, n)] for n in (40, 7, 120, 3, 64, 15)]
    params = [SamplingParams(max_tokens=int(rng.integers(4, 24)), ignore_eos=True,
                             **({"temperature": 0.9, "seed": i} if i % 2 else {"temperature": 0}))
              for i in range(len(prompts))]
    monkeypatch.delenv("INFC_RANK_OVERLAP", raising=False)
    got = {}
    for overlap in (False, True):
        with closing(ranks(art, d, cuda_graphs=True)) as r:
            got[overlap] = engine_tokens(r, prompts, params, max_model_len=2048, max_num_seqs=16,
                                         max_num_batched_tokens=256, overlap=overlap)
    same = got[True] == got[False]
    print(f"[two-gpu] {name} overlapped steps over the ranks give the synchronous tokens: {same}", flush=True)
    assert same
