"""Prompt logprobs in the engine (SamplingParams.prompt_logprobs): one prefill scores every
prompt token, across chunk boundaries, with and without the prefix cache, and gives exactly what
the old path gave: one greedy one-token request per position whose prompt is ids[:i], every
token but ids[i] banned (kept here as the reference)."""
import numpy as np
import pytest

from infc.runtime.engine.engine import Engine
from infc.runtime.engine.runner import CPURunner
from infc.runtime.engine.sampling import SamplingParams
from test_scheduler import tiny_plan  # noqa: F401

K = 3


def forced_reference(engine, prompts: list[list[int]], k: int) -> list[list]:
    """The old path, all positions of all prompts in one engine run: entry i of prompt p is the
    logprob of p[i] after p[:i] and the top k, as a forced-token one-token request reports it."""
    V = engine.runner.vocab_size
    for p, ids in enumerate(prompts):
        for i in range(1, len(ids)):
            ban = [t for t in range(V) if t != ids[i]]
            engine.add_request(ids[:i], SamplingParams(max_tokens=1, min_tokens=1, temperature=0,
                                                       ignore_eos=True, stop_token_ids=ban,
                                                       logprobs=k), f"{p}-{i}")
    got = {}
    while engine.has_unfinished():
        for o in engine.step():
            assert o.error is None, o.error
            if o.token_ids:
                got[o.request_id] = o.token_ids[0], o.logprobs[0]
    out = []
    for p, ids in enumerate(prompts):
        row = [None]
        for i in range(1, len(ids)):
            tok, lp = got[f"{p}-{i}"]
            assert tok == ids[i]
            row.append(lp)
        out.append(row)
    return out


def engine_scores(engine, prompts, k: int, n: int = 1) -> tuple[list[list], dict]:
    """Prompt logprobs of each prompt from the engine's one request each (and its outputs)."""
    for p, ids in enumerate(prompts):
        engine.add_request(ids, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, n=n,
                                               prompt_logprobs=k), f"p{p}")
    scores, outs = {}, {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault((o.request_id, o.index), []).extend(o.token_ids)
            if o.prompt_logprobs is not None:
                assert o.request_id not in scores, "prompt logprobs come once a request"
                scores[o.request_id] = o.prompt_logprobs
    return [scores[f"p{p}"] for p in range(len(prompts))], outs


def assert_same(got: list, want: list, tol: float):
    assert len(got) == len(want) and got[0] is None
    for i, (g, w) in enumerate(zip(got[1:], want[1:]), 1):
        assert g["token"] == w["token"], i
        assert abs(g["logprob"] - w["logprob"]) < tol, (i, g["logprob"], w["logprob"])
        assert [t for t, _ in g["top"]] == [t for t, _ in w["top"]], i
        assert np.allclose([x for _, x in g["top"]], [x for _, x in w["top"]], atol=tol), i
        assert g["rank"] == 1 + sum(x > g["logprob"] + tol for _, x in g["top"]) or g["rank"] > len(g["top"])


@pytest.mark.parametrize("caching", [True, False], ids=["prefix-cache", "no-prefix-cache"])
def test_tiny_model_chunked_prompt_logprobs_equal_forced_tokens(tiny_plan, caching):
    """Prompts over several chunks (8-token budget, 4-token pages); with the prefix cache, the
    second prompt shares the first's leading pages (cached rows have no logits: no hit taken)."""
    plan, weights = tiny_plan
    rng = np.random.default_rng(7)
    a = rng.integers(0, 320, 23).tolist()
    prompts = [a, a[:13] + rng.integers(0, 320, 6).tolist(), rng.integers(0, 320, 9).tolist()]

    def engine():
        return Engine(CPURunner(plan, weights, 64, 4), max_model_len=1024, max_num_batched_tokens=8,
                      enable_prefix_caching=caching)
    want = forced_reference(engine(), prompts, K)
    e = engine()
    e.add_request(a, SamplingParams(max_tokens=1, temperature=0), "warm")   # caches a's pages
    while e.has_unfinished():
        e.step()
    hits = e.metrics.prefix_cache_hits_total
    got, outs = engine_scores(e, prompts, K, n=2)
    for g, w in zip(got, want):
        assert_same(g, w, 1e-5)
    # only the siblings hit (their full pages, the last token never): the scoring ones computed all
    siblings = sum(4 * ((len(p) - 1) // 4) for p in prompts)
    assert e.metrics.prefix_cache_hits_total - hits == (siblings if caching else 0)
    for p in range(3):                      # the n = 2 siblings generate as the scoring one
        assert outs[(f"p{p}", 0)] == outs[(f"p{p}", 1)]


def assert_tail_inputs_kept(plan, T=7, B=3):
    """No launch of the logits tail writes where the tail's inputs live (plan_memory keeps them
    to the end of the step, so the runtime can re-run the tail after the program)."""
    from infc.compiler.contract.schema import DTYPE_BYTES

    def span(name):
        b = plan["buffers"][name]
        o = b["offset"]
        start = o["T"] * T + o["B"] * B + o["bytes"]
        return start, start + int(np.prod([{"T": T, "B": B}.get(x, x) for x in b["shape"]])) * DTYPE_BYTES[b["dtype"]]
    kept = [span(n) for n in plan["row_logits"]["inputs"]]
    for out in plan["row_logits"]["tail"]:
        a, z = span(out)
        assert all(z <= s or e <= a for s, e in kept), (out, plan["row_logits"])


def test_row_logits_of_an_unfused_plan_equal_each_prefix_last_logits(tiny_model):
    """--no-fuse: the tail is last -> rms_norm -> linear, three launches re-run at other rows; row
    j of a prefill gives the logits the prefill of its first j + 1 tokens gives at its last row."""
    from infc.compiler.build import compile_model
    from infc.runtime.reference.executor import ReferenceExecutor
    from infc.compiler.contract.safetensors_io import Checkpoint
    from infc.runtime.weights.load import load_weights
    from infc.runtime.engine.step import Chunk
    d, _ = tiny_model("qwen3")
    _, plan = compile_model(model_dir=str(d), fuse=False)
    ops = {l["outputs"][0]: l["op"] for l in plan["programs"]["prefill"] if "op" in l}
    assert [ops[n] for n in plan["row_logits"]["tail"]] == ["last", "rms_norm", "linear"]
    for p in (plan, compile_model("c4ai-command-r-v01")[1]):    # Cohere: LayerNorm, never fused
        assert_tail_inputs_kept(p)
    ex = ReferenceExecutor(plan, load_weights(plan, Checkpoint(d)))
    ids = np.random.default_rng(3).integers(0, 320, 11).tolist()
    ex.allocate_pages(8, 16)
    meta = ex.oracle.step([Chunk(0, ids, 0)])
    _, blocks = ex._execute(meta, ex.oracle.storage, [2, 7, 10])
    (at, rows), = list(blocks)
    for k, j in enumerate([2, 7, 10]):
        ex.free(1)
        want = ex.step([Chunk(1, ids[:j + 1], 0)])[0]
        assert np.allclose(rows[k], want, atol=1e-4), j
