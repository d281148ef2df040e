"""LoRA requests through the engine over the CPU runner: each request's adapter reaches its rows
(step metadata lora_slots), the served tokens equal the single-adapter runs, adapters swap
through the slots while others run, and the prefix cache is keyed by adapter."""
import numpy as np
import pytest

from infc.compiler.build import compile_model
from infc.compiler.contract.safetensors_io import Checkpoint
from infc.config import lora_build
from infc.runtime.engine.engine import Engine
from infc.runtime.engine.runner import CPURunner
from infc.runtime.engine.sampling import SamplingParams
from infc.runtime.reference.executor import ReferenceExecutor, SeqChunk
from infc.runtime.weights.load import load_weights

from make_lora_adapter import make_adapter

GREEDY = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tiny_model, tmp_path_factory):
    d, _ = tiny_model("qwen3")
    root = tmp_path_factory.mktemp("adapters")
    for i, name in enumerate("abcd"):
        make_adapter(d, root / name, rank=(8, 16, 4, 12)[i], alpha=16, seed=10 + i)
    return d, root


def _engine(d, root, max_loras, names="abcd", page_size=4, **kw):
    _, plan = compile_model(model_dir=d, lora=lora_build(max_loras, 16))
    runner = CPURunner(plan, load_weights(plan, Checkpoint(d)), 96, page_size=page_size)
    engine = Engine(runner, max_num_seqs=8, max_num_batched_tokens=256, **kw)
    for n in names:
        engine.loras.register(n, root / n)
    return engine


def _run(engine, requests, params=GREEDY) -> dict:
    for rid, (prompt, lora) in requests.items():
        engine.add_request(prompt, params, rid, lora=lora)
    out: dict = {}
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.token_ids)
    return out


PROMPTS = [[5, 17, 200, 3, 9, 44, 21], [8, 8, 120, 77, 6], [31, 2, 250, 19, 60, 7, 11, 90], [4, 99, 13]]


def test_mixed_adapters_served_as_each_alone_and_swapped_through_two_slots(model):
    d, root = model
    reqs = {f"r{i}{n or 'base'}": (p, n) for i, p in enumerate(PROMPTS) for n in ("a", "b", "c", "d", None)}
    # alone: one request at a time, a slot for every adapter
    alone = {}
    for rid, r in reqs.items():
        alone.update(_run(_engine(d, root, 4), {rid: r}))
    # together, 20 requests over 4 adapters and the base in 2 slots: adapters wait and swap
    engine = _engine(d, root, 2)
    together = _run(engine, reqs)
    assert together == alone
    assert engine.loras.loads > 4                    # slots were reused for other adapters
    assert len({tuple(t) for rid, t in alone.items() if rid.startswith("r0")}) == 5   # adapters differ
    assert all(not h for h in engine.loras.holders.values())      # every slot given back


def test_a_request_naming_no_loaded_adapter_is_refused(model):
    d, root = model
    engine = _engine(d, root, 2, names="a")
    with pytest.raises(ValueError, match="LoRA adapter 'zz' is not loaded"):
        engine.add_request([1, 2, 3], GREEDY, "x", lora="zz")
    _, plan = compile_model(model_dir=d)
    plain = Engine(CPURunner(plan, load_weights(plan, Checkpoint(d)), 32))
    with pytest.raises(ValueError, match="serves no adapters"):
        plain.add_request([1, 2, 3], GREEDY, "x", lora="a")


def test_the_prefix_cache_is_keyed_by_adapter(model):
    d, root = model
    engine = _engine(d, root, 2, page_size=4)
    prompt = [7, 3, 99, 12, 40, 8, 8, 61, 5, 23, 77]     # two full pages of 4
    first = _run(engine, {"a1": (prompt, "a")})
    hits = engine.bm.hit_tokens
    second = _run(engine, {"b1": (prompt, "b"), "base": (prompt, None)})
    assert engine.bm.hit_tokens == hits                  # nothing of a's cache served b or the base
    third = _run(engine, {"a2": (prompt, "a")})
    assert engine.bm.hit_tokens == hits + 8               # a's own blocks serve a again
    assert third["a2"] == first["a1"] != second["b1"]
    # an adapter loaded again under the same name is another adapter: a's blocks are not its
    engine.loras.unregister("a")
    engine.loras.register("a", root / "c")
    fourth = _run(engine, {"a3": (prompt, "a")})
    assert engine.bm.hit_tokens == hits + 8 and fourth["a3"] != first["a1"]


def test_tables_start_as_zeros_whatever_the_loader_filled(model):
    d, root = model
    _, plan = compile_model(model_dir=d, lora=lora_build(2, 8))
    weights = load_weights(plan, Checkpoint(d))
    gen = np.random.default_rng(0)
    for name in weights:
        if "_lora_" in name:
            weights[name] = [gen.standard_normal(w.shape).astype(np.float32) for w in weights[name]]
    runner = CPURunner(plan, weights, 32)
    Engine(runner)
    _, base = compile_model(model_dir=d)
    want = ReferenceExecutor(base, load_weights(base, Checkpoint(d))).step([SeqChunk(0, PROMPTS[0], 0)])
    got = ReferenceExecutor(plan, runner.executor.weights).step([SeqChunk(0, PROMPTS[0], 0)])
    np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(), rtol=0)


def test_lora_requests_info_names_the_running_and_waiting_adapters(model):
    d, root = model
    engine = _engine(d, root, 1, names="ab")
    engine.add_request(PROMPTS[0], GREEDY, "x", lora="a")
    engine.add_request(PROMPTS[1], GREEDY, "y", lora="b")
    engine.add_request(PROMPTS[2], GREEDY, "z")
    assert engine.metrics.lora_requests_info == {"running_lora_adapters": "", "waiting_lora_adapters": "a,b",
                                                 "max_lora": "1"}
    engine.step()                                   # one slot: a runs, b waits for it
    assert engine.metrics.lora_requests_info["running_lora_adapters"] == "a"
    assert engine.metrics.lora_requests_info["waiting_lora_adapters"] == "b"


def test_async_engine_loads_between_steps_and_a_dead_engine_refuses(model):
    import asyncio
    from infc.runtime.engine.async_engine import AsyncEngine, EngineDeadError
    from infc.runtime.lora.tables import AdapterError
    d, root = model
    ae = AsyncEngine(_engine(d, root, 2, names="a"))
    try:
        assert asyncio.run(ae.load_lora("b", str(root / "b"))) >= 1 and ae.lora_names() == ["a", "b"]
        with pytest.raises(AdapterError, match="no such directory"):
            asyncio.run(ae.load_lora("c", str(root / "nope")))
        asyncio.run(ae.unload_lora("a"))
        assert ae.lora_names() == ["b"]
    finally:
        ae.shutdown()
    with pytest.raises(EngineDeadError):
        asyncio.run(ae.load_lora("c", str(root / "c")))


def test_llm_generates_with_an_adapter_by_name_or_lora_request(model):
    from types import SimpleNamespace
    from infc import LLM
    d, root = model
    want = _run(_engine(d, root, 2), {"x": (PROMPTS[0], "a"), "y": (PROMPTS[0], "b"), "z": (PROMPTS[0], None)})
    with LLM(d, enable_lora=True, max_loras=2, max_lora_rank=16, lora_modules={"a": str(root / "a")}) as llm:
        assert llm.generate([PROMPTS[0]], GREEDY, lora_request="a")[0].token_ids == want["x"]
        got = llm.generate([PROMPTS[0]], GREEDY, lora_request=SimpleNamespace(lora_name="b", lora_path=root / "b"))
        assert got[0].token_ids == want["y"]
        assert llm.generate([PROMPTS[0]], GREEDY)[0].token_ids == want["z"]


def test_speculative_draft_rows_take_their_sequences_adapter(model):
    """n-gram speculation beside LoRA: a sequence's draft rows sit after the step's other rows,
    and each row reads its own sequence's adapter slot (lora_slots per chunk), so mixed adapters
    speculate with the tokens of plain decoding. Prompts that repeat themselves so drafts exist."""
    from infc.config import speculative_config
    d, root = model
    loop = [7, 3, 9, 11, 7, 3, 9, 11, 7, 3, 9, 11]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    reqs = {f"{n or 'base'}{i}": (p, n) for i, p in enumerate([loop, loop[:9] + [5, 7, 3, 9]])
            for n in ("a", "b", None)}
    plain = _run(_engine(d, root, 3, names="ab"), reqs, params)
    spec = _engine(d, root, 3, names="ab", speculative_config=speculative_config(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 3}))
    assert _run(spec, reqs, params) == plain
    assert spec.metrics.spec_decode_num_draft_tokens_total > 0
