"""A draft model on the CUDA runner (issue 43), on the fake device of tests/test_cuda_ranks.py
(host memory, the plans' real kernels under the Triton interpreter, graphs replayed by
re-issuing): infc/backend.py's _cuda_runners loads the target's and the draft's CudaRunner in one
process (weights first, then one cache budget split so both caches hold the same tokens, then
each its caches and graphs), and the engine drives the draft's runner through DraftProposer as on
the CPU. Outputs are plain decoding's on the same target runner, greedy and seeded sampling; a
self-draft accepts every draft; a draft of other weights (one layer) is rejected and rolled back
in both caches, nothing held after; the split arithmetic (compiler/memory_budget.draft_pages)
holds exactly at the boundary. The fake-device cases run the interpreter for every launch
(15-25 s each on an idle CI core): --exhaustive only."""
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from infc.compiler.build import build
from infc.compiler.contract import caches
from infc.compiler.memory_budget import draft_pages, draft_split_line
from infc.config import EngineConfig, speculative_config
from infc.runtime.engine.engine import Engine
from infc.runtime.engine.sampling import SamplingParams
from exhaustive import EXHAUSTIVE
from test_cuda_ranks import FakeCtx, FakeGraph, cuda_mods, fake_device, fake_launch  # noqa: F401
from test_scheduler import tiny_plan  # noqa: F401


@pytest.fixture(scope="module")
def artifacts(tiny_model, tmp_path_factory):
    """name -> (model directory, artifact with rendered kernels, no cubins)."""
    out = {}

    def get(name):
        if name not in out:
            d, _ = tiny_model("qwen3", **({"num_hidden_layers": 1} if name == "l1" else {}))
            art = tmp_path_factory.mktemp(f"draft-cuda-{name}")
            build(model_dir=str(d), out=art, compile=False, log=None)
            out[name] = d, art
        return out[name]
    return get


def _runners(fake_device, monkeypatch, target, draft, k, max_num_seqs=4):
    """(target runner, draft runner, startup lines) through the backend's own loader, both runners
    on one fake device (every Context() the same memory, as one GPU's)."""
    from infc import backend
    monkeypatch.setattr(fake_device.runner, "Graph", FakeGraph)
    monkeypatch.setattr(sys.modules["infc.runtime.cuda.sampler"], "launch", fake_launch)
    ctx = FakeCtx(24 << 20)
    monkeypatch.setattr(fake_device.runner, "Context", lambda: ctx)
    c = backend.resolve(EngineConfig.from_settings(
        device="cuda", max_num_seqs=max_num_seqs, max_num_batched_tokens=24, block_size=16, gpu_memory_utilization=0.5,
        speculative_config={"method": "draft_model", "model": str(draft[0]), "num_speculative_tokens": k}))
    lines, split = [], []
    import infc.compiler.memory_budget as mb
    draft_pages = mb.draft_pages
    monkeypatch.setattr(mb, "draft_pages", lambda *a: split.append((a, draft_pages(*a))) or split[-1][1])
    t, d = backend._cuda_runners(backend._Stages(None), c, target[1], target[0], (draft[1], draft[0]), lines.append)
    (args, pages), = split
    return t, d, lines, ctx, args[3]


def _decode(engine, prompts, params) -> dict:
    for i, p in enumerate(prompts):
        engine.add_request(p, params[i % len(params)], f"r{i}")
    out = {}
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.token_ids)
    return out


PARAMS = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
          SamplingParams(max_tokens=5, temperature=0.9, top_k=40, seed=3, ignore_eos=True)]


def _check(fake_device, monkeypatch, artifacts, target_name, draft_name, rng, lengths=(11, 4), params=PARAMS,
           max_num_seqs=4):
    """Both runners through the backend, then plain and speculative decoding on them (each
    case 15-25 s of the interpreter: exhaustive; the split's arithmetic is the fast case)."""
    target = artifacts(target_name)
    t, d, lines, ctx, budget = _runners(fake_device, monkeypatch, target, artifacts(draft_name), 3, max_num_seqs)
    try:
        # the split: both caches the same pages, what draft_pages made of the budget left after
        # both runners' weights, arenas and scratch (gpu_memory_utilization 0.5 of the device); the
        # two caches fit in it, with one page more each they would not
        tc, dc = caches.of_plan(t.plan), caches.of_plan(d.plan)
        assert t.num_pages == d.num_pages > 1 and t.page_size == d.page_size == 16
        regions = sum(len(c["layers"]) for c in (*tc.values(), *dc.values()))
        assert t.caches.nbytes + d.caches.nbytes <= budget < caches.ALIGN * regions + sum(
            caches.storage_bytes(x, 16, t.num_pages + 1) for x in (tc, dc))
        assert 0 < budget < ctx.mem.numel() // 2
        (line,) = [x for x in lines if "KV cache split" in x]
        assert f"{t.num_pages} pages x 16 tokens each" in line
        assert t.caches is not d.caches and t.arena != d.arena and t.staging is not d.staging
        assert len(t.graphs) == len(d.graphs) == len(t.buckets) and t.graphs is not d.graphs
        prompts = [rng.integers(0, 320, n).tolist() for n in lengths]
        common = dict(max_model_len=256, max_num_seqs=max_num_seqs, max_num_batched_tokens=24)
        plain = _decode(Engine(t, **common), prompts, params)
        e = Engine(t, **common, draft_runner=d, speculative_config=speculative_config(
            {"method": "draft_model", "model": "d", "num_speculative_tokens": 3}))
        replays = FakeGraph.replays
        got = _decode(e, prompts, params)
        assert got == plain and [len(got[f"r{i}"]) for i in range(len(prompts))] == \
            [params[i % len(params)].max_tokens for i in range(len(prompts))]
        assert FakeGraph.replays > replays                  # the draft's chained steps from its graphs
        m = e.metrics
        assert m.spec_decode_num_draft_tokens_total > 0
        assert e.spec.draft.forwards >= 2 and not e.spec.draft.with_probs   # exact match: logits on the device
        assert e.bm.num_free_pages == t.num_pages and e.spec.draft.held_pages() == 0
        assert not e.spec.draft.shadows
        return m, t, d
    finally:
        t.close()
        d.close()


@EXHAUSTIVE
def test_a_self_draft_on_the_cuda_runner(fake_device, monkeypatch, artifacts, rng):
    m, t, d = _check(fake_device, monkeypatch, artifacts, "qwen3", "qwen3", rng)
    assert m.spec_decode_num_accepted_tokens_total == m.spec_decode_num_draft_tokens_total


@EXHAUSTIVE
def test_a_one_layer_draft_on_the_cuda_runner(fake_device, monkeypatch, artifacts, rng):
    m, *_ = _check(fake_device, monkeypatch, artifacts, "qwen3", "l1", rng)
    assert m.spec_decode_num_accepted_tokens_total < m.spec_decode_num_draft_tokens_total


def test_the_split_gives_both_caches_the_same_tokens_within_the_budget(tiny_plan):  # noqa: F811
    plan, _ = tiny_plan
    tc = caches.of_plan(plan)
    dc = {n: dict(c, layers=c["layers"][:1]) for n, c in tc.items()}      # a one-layer draft
    ps, align = 16, caches.ALIGN

    def need(pages, slots=0):      # the two DeviceCaches' bytes at most (each region aligned)
        regions = sum(len(c["layers"]) for c in (*tc.values(), *dc.values()))
        return (caches.storage_bytes(tc, ps, pages, slots) + caches.storage_bytes(dc, ps, pages)
                + align * regions)

    for budget in (need(7), need(7) + 1, need(8) - 1, 3 << 20):
        n = draft_pages(tc, dc, ps, budget)
        assert need(n) <= budget < need(n + 1), (budget, n)
    # a draft of the target's caches: half the pages a cache of its own would get
    alone = caches.pages_for_budget(tc, ps, 1 << 22)
    assert abs(draft_pages(tc, tc, ps, 1 << 22) + 1 - (alone + 1) / 2) <= 1
    line = draft_split_line(tc, dc, ps, 7, 1 << 30)
    assert "pages x 16 tokens each" in line and "of 1.00 GiB" in line
    assert "as asked" in draft_split_line(tc, dc, ps, 7, None)


def test_the_drafts_artifact_is_the_targets_or_its_own_and_checked_before_loading(tiny_model, tmp_path, monkeypatch):
    """_cuda_draft_artifact (no device touched): a self-draft reuses the target's very artifact
    (no build); another directory is built into .cache/artifacts/<its name> with the target's
    page size ("-draft" where that is the target's own artifact directory); a draft of another
    vocabulary is refused by the engine's own check before any weights load; and with parallel
    ranks a draft is refused before anything loads."""
    import infc.compiler.build as build_mod
    from infc import backend
    repo = tmp_path / "repo"
    monkeypatch.setattr(build_mod, "REPO", repo)
    monkeypatch.setattr(backend, "SERVED_ARTIFACTS", repo / ".cache" / "artifacts")
    builds = []

    def plan_only(out, **kw):           # the plan a build writes (its page size), no kernels
        builds.append(kw)
        _, plan = build_mod.compile_model(model_dir=kw["model_dir"], check_checkpoint=kw["check_checkpoint"])
        Path(out).mkdir(parents=True)
        (Path(out) / "plan.json").write_text(json.dumps({**plan, "build": {"page_size": kw["page_size"]}}))
        return Path(out)
    monkeypatch.setattr(build_mod, "build", plan_only)
    d, _ = tiny_model("qwen3")
    target = plan_only(repo / ".cache" / "artifacts" / d.name, model_dir=str(d), page_size=32, check_checkpoint=True)
    builds.clear()

    def config(model):
        return backend.resolve(EngineConfig.from_settings(device="cuda", speculative_config={
            "method": "draft_model", "model": str(model), "num_speculative_tokens": 2}))

    def draft_of(model):                                 # (dummy: config-only directories)
        return backend._cuda_draft_artifact(backend._Stages(None), config(model), None, True, "auto", d, target)

    def config_only(where, **over):
        where.mkdir(parents=True)
        cfg = json.loads((d / "config.json").read_text())
        (where / "config.json").write_text(json.dumps({**cfg, **over}))
        return where

    assert draft_of(d) == (target, d) and builds == []
    other = config_only(tmp_path / "other" / d.name, num_hidden_layers=1)   # the target's directory name
    art, where = draft_of(other)
    assert where == other and art == target.with_name(d.name + "-draft")
    assert [(b["page_size"], b["check_checkpoint"]) for b in builds] == [(32, False)]
    assert json.loads((art / "plan.json").read_text())["config"]["L"] == 1
    with pytest.raises(ValueError, match="its vocabulary has 300 tokens and the target's 320"):
        draft_of(config_only(tmp_path / "small", vocab_size=300))
    with pytest.raises(ValueError, match="a draft model with parallel ranks is not supported yet"):
        backend.load_backend(d, EngineConfig.from_settings(
            device="cuda", tensor_parallel_size=2, speculative_config={
                "method": "draft_model", "model": str(d), "num_speculative_tokens": 2}), log=None)
