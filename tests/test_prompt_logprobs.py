"""Prompt logprobs in the engine (SamplingParams.prompt_logprobs): one prefill scores every
prompt token, across chunk boundaries, with and without the prefix cache, and gives exactly what
the old path gave: one greedy one-token request per position whose prompt is ids[:i], every
token but ids[i] banned (kept here as the reference)."""
import numpy as np
import pytest

from infc.runtime.engine.engine import Engine
from infc.runtime.engine.runner import CPURunner
from infc.runtime.engine.sampling import SamplingParams
from prompt_scoring import assert_same, engine_scores, forced_reference
from test_scheduler import tiny_plan  # noqa: F401

K = 3


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


def test_llm_request_output_carries_prompt_logprobs(tiny_model, tiny_plan):
    """LLM.generate hands them out as vLLM's RequestOutput.prompt_logprobs: the engine's."""
    from infc.llm import LLM
    d, _ = tiny_model("qwen3")
    ids = np.random.default_rng(5).integers(0, 320, 12).tolist()
    (out,) = LLM(d, device="cpu", kv_cache_tokens=256).generate(
        ids, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2))
    plan, weights = tiny_plan
    want, _ = engine_scores(Engine(CPURunner(plan, weights, 64, 16), max_model_len=1024), [ids], 2)
    assert_same(out.prompt_logprobs, want[0], 1e-5)


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
