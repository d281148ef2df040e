"""MTP speculation on the CUDA runner (issue 43), on the fake device of tests/test_cuda_ranks.py
(host memory, the plans' real kernels under the Triton interpreter, graphs replayed by re-issuing),
over test_spec_mtp.py's tiny DeepSeek-V3 and Qwen3.5 checkpoints with an MTP layer.

- The MTP layer's CudaRunner beside a target CudaRunner holds no copy of the tensors they share:
  its embedding, final norm and lm_head are the target's device pointers.
- The MTP layer's CudaRunner (its own artifact: compile_model(section="mtp"); the embedding, final
  norm and lm_head the target CudaRunner's device pointers, infc/mtp_cuda.py) driven by
  EagleProposer proposes the CPU MTP runner's drafts for the same target rows, over a catch-up, a
  chain of k steps (the decode graph) and a rollback, its hidden_out within bf16 of the CPU's.
- The backend's cuda path (the target built with its last hidden state as an output, the MTP
  artifact beside it, both runners on one device with the cache split): greedy output is plain
  decoding's on the same target runner, nothing held after.
- Parallel ranks and an --artifact without the hidden state are refused before anything loads; a
  checkpoint lacking an MTP tensor when the layer's runner loads, naming it."""
import json
import shutil
import sys

import numpy as np
import pytest

from exhaustive import EXHAUSTIVE
from infc.compiler.spec import SPECS_DIR
from infc.runtime.engine.sampling import SamplingParams
from spec_rounds import same_drafts_each_round
from test_cuda_ranks import FakeCtx, FakeGraph, cuda_mods, fake_device, fake_launch  # noqa: F401
from test_spec_mtp import FAMILIES, L, MTP, V, _save, _tensors, models  # noqa: F401

SHARED = ("embed", "final_norm", "lm_head")          # the tensors the MTP plans share with the target


def _spread(d, out):
    """A copy of model directory d whose lm_head rows have growing norms (the DeepSeek layer's
    shared_head.head, a copy, too): logits with clear maxima, so bf16 on the device and float32 on
    the cpu pick the same drafts (random tiny models have near-ties that rounding flips)."""
    shutil.copytree(d, out)
    t = _tensors(out)
    scale = np.exp(np.linspace(0, 3, V, dtype=np.float32))[:, None]
    for k in [k for k in t if k == "lm_head.weight" or k.endswith("shared_head.head.weight")]:
        t[k] = t[k] * scale
    _save(out, t, json.loads((out / "config.json").read_text()))
    return out


@pytest.fixture(scope="module")
def built(models, tmp_path_factory):  # noqa: F811
    """family -> (spread model directory, its target artifact with the hidden state of layer L,
    its MTP artifact): kernels rendered, no cubins."""
    from infc.compiler.build import build
    out = {}
    for fam, (d, _) in models.items():
        where = tmp_path_factory.mktemp(f"mtp-cuda-{fam}")
        s = _spread(d, where / f"mtp-{fam}")
        spec = str(SPECS_DIR / FAMILIES[fam][2])
        kw = dict(model_dir=str(s), spec_path=spec, compile=False, log=None, page_size=16)
        out[fam] = (s, build(out=where / "target", capture=[L], **kw),
                    build(out=where / "mtp", section="mtp", check_checkpoint=False, **kw))
    return out


def _bf16(x):
    from infc.runtime.cuda.plan_io import from_bf16, to_bf16
    return from_bf16(to_bf16(x))


def _cpu_mtp(d, fam):
    """The CPU MTP runner of d (infc/backend.py _mtp_runner's plan), its float weights rounded to
    bf16 as the device stores them."""
    from infc.compiler.build import compile_model
    from infc.compiler.contract.safetensors_io import Checkpoint
    from infc.runtime.engine.runner import CPURunner
    from infc.runtime.weights.load import load_weights
    _, plan = compile_model(model_dir=str(d), spec_path=str(SPECS_DIR / FAMILIES[fam][2]),
                            check_checkpoint=False, section="mtp")
    weights = load_weights(plan, Checkpoint(d))
    for k, w in weights.items():                      # an array, or a list of one per layer
        if plan["weights"][k]["dtype"] == "bf16":
            weights[k] = [_bf16(a) for a in w] if isinstance(w, list) else _bf16(w)
    return CPURunner(plan, weights, num_pages=12, page_size=16)


def _gpu_pair(fake_device, built, fam, ctx):
    """(target CudaRunner, weights only; the MTP layer's CudaRunner beside it, sharing them)."""
    from infc.mtp_cuda import cuda_mtp_weights
    d, tart, mart = built[fam]
    target = fake_device.runner.CudaRunner(tart, d, max_num_batched_tokens=24, max_num_seqs=2, ctx=ctx,
                                           defer_cache=True)
    shared, d2t = cuda_mtp_weights(None, target, mart)
    gpu = fake_device.runner.CudaRunner(mart, d, max_num_batched_tokens=24, max_num_seqs=2, num_pages=12,
                                        ctx=ctx, shared_weights=shared, buckets=[2])
    gpu.d2t = d2t
    return target, gpu


def test_the_mtp_runner_shares_the_targets_device_tensors(fake_device, monkeypatch, built):
    """The MTP CudaRunner's embedding, final norm and lm_head are the target runner's device
    pointers (no second copy: the device memory it takes is less by exactly their bytes), its
    own layer's weights its own; d2t the identity (zeros) over the target's vocabulary."""
    from infc.runtime.cuda.weights import nbytes
    monkeypatch.setattr(fake_device.runner, "Graph", FakeGraph)      # captured, never replayed
    for fam in sorted(built):
        ctx = FakeCtx(24 << 20)
        target, gpu = _gpu_pair(fake_device, built, fam, ctx)
        try:
            for name in SHARED:
                assert gpu.weights.ptr(name, None) == target.weights.ptr(name, None), (fam, name)
            mine = {n for n in gpu.plan["weights"] if n not in SHARED}
            assert mine and all(gpu.weights.ptr(n, None) != target.weights.ptr(n, None)
                                for n in mine if n in target.plan["weights"]
                                and gpu.plan["weights"][n]["layers"] is None)
            shared_bytes = sum(nbytes(gpu.plan["weights"][n]["dtype"], gpu.plan["weights"][n]["shape"])
                               for n in SHARED)
            total = sum(nbytes(w["dtype"], w["shape"]) * (len(w["layers"]) if w["layers"] else 1)
                        for w in gpu.plan["weights"].values())
            assert gpu.weights.bytes <= total - shared_bytes, fam
            assert gpu.d2t.shape == (V,) and not gpu.d2t.any()
        finally:
            gpu.close()
            target.close()


@pytest.mark.parametrize("fam,rounds", [("qwen3_5", 2), ("deepseek_v3", 2),
                                        pytest.param("deepseek_v3", 1, marks=EXHAUSTIVE)])
def test_the_mtp_layer_on_the_cuda_runner_proposes_the_cpu_drafts(fake_device, monkeypatch, built, rng,
                                                                   fam, rounds):
    """Two sequences' catch-up (a prefill step over the target rows) and chain (decode steps: the
    bucket's graph); with two rounds the rollback and the catch-up over the verified rows before
    the next chain. The same target hidden states go to both runners."""
    from infc.runtime.engine.sequence import Sequence
    from infc.runtime.engine.speculative.eagle import EagleProposer
    monkeypatch.setattr(fake_device.runner, "Graph", FakeGraph)
    d, _, _ = built[fam]
    H = json.loads((d / "config.json").read_text())["hidden_size"]
    ctx = FakeCtx(24 << 20)
    target, gpu = _gpu_pair(fake_device, built, fam, ctx)
    cpu = _cpu_mtp(d, fam)
    assert gpu.inputs.keys() == {"aux", "hidden"}
    props = [EagleProposer(r, np.zeros(V, np.int64), 24, 256) for r in (cpu, gpu)]
    seen = [[], []]                                   # each MTP step's logits, per proposer
    for prop, log in zip(props, seen):
        prop._logits = lambda meta, f=prop._logits, log=log: log.append(np.array(f(meta))) or log[-1]
    params = SamplingParams(max_tokens=50, temperature=0)
    prompts = [list(map(int, rng.integers(0, V, n))) for n in (7, 4)]
    seqs = [[Sequence(i, f"r{i}", 0, list(p), params, 0) for i, p in enumerate(prompts)] for _ in props]
    # the target's residual stream after its last layer, as bf16 (what the device's buffer holds)
    aux = [_bf16(rng.standard_normal((32, H)).astype(np.float32)) for _ in range(2)]
    try:
        same_drafts_each_round(props, seqs, seen, aux, cpu, gpu, H, rounds, FakeGraph)
    finally:
        gpu.close()
        target.close()


# -- the backend's path: both runners on one fake device ------------------------------------------
@pytest.mark.parametrize("fam", ["qwen3_5", pytest.param("deepseek_v3", marks=EXHAUSTIVE)])
def test_mtp_on_the_cuda_runner_is_plain_decoding(fake_device, monkeypatch, models, fam, tmp_path, rng):  # noqa: F811
    """load_backend on cuda (the builds into a temporary .cache): the target's artifact outputs
    aux_hidden (layer L), the MTP artifact is built beside it under <name>-mtp, its runner a
    CudaRunner (not the cpu's) sharing the target's tensors, the caches split; then plain and MTP
    decoding on the same target runner, greedy and seeded sampled (the GPU verifies coupled draws
    by exact match): the same tokens, drafts made, every page back."""
    import infc.compiler.build as build_mod
    from infc import backend
    from infc.config import EngineConfig, speculative_config
    from infc.runtime.engine.engine import Engine
    from test_spec_draft_cuda import _decode
    d, _ = models[fam]
    monkeypatch.setattr(build_mod, "REPO", tmp_path)
    monkeypatch.setattr(backend, "SERVED_ARTIFACTS", tmp_path / ".cache" / "artifacts")
    real_build = build_mod.build
    monkeypatch.setattr(build_mod, "build", lambda **kw: real_build(**dict(kw, compile=False)))
    monkeypatch.setattr(fake_device.runner, "Graph", FakeGraph)
    monkeypatch.setattr(sys.modules["infc.runtime.cuda.sampler"], "launch", fake_launch)
    ctx = FakeCtx(32 << 20)
    monkeypatch.setattr(fake_device.runner, "Context", lambda: ctx)
    b = backend.load_backend(d, EngineConfig.from_settings(
        device="cuda", max_num_seqs=4, max_num_batched_tokens=24, block_size=16, gpu_memory_utilization=0.5,
        speculative_config=dict(MTP, num_speculative_tokens=2), spec=str(SPECS_DIR / FAMILIES[fam][2]),
        asynchronous=False), log=None)
    e = getattr(b.engine, "engine", b.engine)
    t, mr = e.runner, e.spec.draft.runner
    try:
        assert isinstance(mr, fake_device.runner.CudaRunner) and mr is not t
        assert t.artifact.name == d.name + f"-eagle3-{L}" and "aux_hidden" in t.plan["outputs"]
        assert mr.artifact == tmp_path / ".cache" / "artifacts" / (d.name + "-mtp")
        assert all(mr.weights.ptr(n, None) == t.weights.ptr(n, None) for n in SHARED)
        assert t.num_pages == mr.num_pages
        prompts = [rng.integers(0, V, n).tolist() for n in (11, 4)]
        params = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                  SamplingParams(max_tokens=5, temperature=0.9, top_k=40, seed=3, ignore_eos=True)]
        got = _decode(e, prompts, params)
        plain = _decode(Engine(t, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=24), prompts, params)
        assert got == plain and [len(got["r0"]), len(got["r1"])] == [6, 5]
        assert e.metrics.spec_decode_num_draft_tokens_total > 0 and e.spec.draft.forwards >= 2
        assert e.bm.num_free_pages == t.num_pages and e.spec.draft.held_pages() == 0
    finally:
        e.close()
        t.close()
        mr.close()


def test_what_mtp_on_cuda_still_refuses(models, tmp_path):  # noqa: F811
    """Parallel ranks, and an --artifact built without the hidden state the MTP layer reads:
    refused before anything loads, saying why."""
    from infc.backend import load_backend
    from infc.config import EngineConfig
    d, _ = models["deepseek_v3"]
    with pytest.raises(ValueError, match=r"method 'mtp': with parallel ranks \(tensor, data or expert parallel\) "
                                         r"is not supported"):
        load_backend(d, EngineConfig.from_settings(device="cuda", tensor_parallel_size=2,
                                                   speculative_config=MTP), log=None)
    art = tmp_path / "plain"                       # a plan without aux_hidden (only its outputs read)
    art.mkdir()
    (art / "plan.json").write_text(json.dumps({"outputs": {"logits": "logits.0"}}))
    with pytest.raises(ValueError, match="built without the hidden state the MTP layer reads"):
        load_backend(d, EngineConfig.from_settings(device="cuda", artifact=str(art), speculative_config=MTP),
                     log=None)


def test_a_checkpoint_lacking_the_mtp_weights_is_refused_on_cuda(fake_device, monkeypatch, models,  # noqa: F811
                                                                  tmp_path):
    """A config.json declaring the MTP layer over a checkpoint without one of its tensors: the
    MTP runner's load fails naming the tensor, as the cpu's does, and the target's runner is
    closed (nothing held)."""
    from infc import backend
    from infc.compiler.build import build
    from infc.config import EngineConfig
    from infc.mtp_cuda import cuda_mtp_weights
    from test_spec_mtp import _edited
    d, _ = models["deepseek_v3"]
    lacking = _edited(d, tmp_path / "mtp-deepseek_v3-lacking", {"x": lambda n: ".eh_proj." in n})
    kw = dict(model_dir=str(lacking), spec_path=str(SPECS_DIR / "deepseek_v2.yaml"), compile=False, log=None,
              page_size=16)
    art, mart = build(out=tmp_path / "t", capture=[L], **kw), build(out=tmp_path / "m", section="mtp",
                                                                   check_checkpoint=False, **kw)
    ctx = FakeCtx(24 << 20)
    closed = []
    real = fake_device.runner.CudaRunner.close
    runner = type("Runner", (fake_device.runner.CudaRunner,),
                  {"close": lambda self: closed.append(self) or real(self)})
    c = backend.resolve(EngineConfig.from_settings(device="cuda", max_num_seqs=2, max_num_batched_tokens=24,
                                                   speculative_config=MTP))
    monkeypatch.setattr(fake_device.runner, "CudaRunner", runner)
    monkeypatch.setattr(fake_device.runner, "Context", lambda: ctx)
    with pytest.raises(ValueError, match=rf"method 'mtp': the checkpoint's MTP layer cannot be read .*"
                                            rf"tensor 'model.layers.{L}.eh_proj.weight' is missing"):
        backend._cuda_runners(backend._Stages(None), c, art, lacking, (mart, lacking), None,
                              head=cuda_mtp_weights, what="MTP")
    assert len(closed) == 1                          # the target's, loaded first
