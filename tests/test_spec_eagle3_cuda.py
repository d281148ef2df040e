"""EAGLE-3 on the CUDA runner (issue 43), on the fake device of tests/test_cuda_ranks.py (host
memory, the plans' real kernels under the Triton interpreter, graphs replayed by re-issuing).

- The head's CudaRunner (its plan's step inputs aux / hidden uploaded with each step, hidden_out
  read back: runtime/cuda/plan_io.py; the target's embedding table shared by pointer) driven by
  EagleProposer proposes the CPU head's drafts for the same target rows, over a catch-up, a chain
  of k steps (decode steps: the head's CUDA graphs) and a rollback, its hidden_out within bf16 of
  the CPU's.
- The whole backend path (infc/backend.py: the target built with the head's hidden states as an
  output, the head built from specs/eagle3.yaml, both runners on one device with the cache split):
  greedy and seeded outputs are plain decoding's on the same target runner, nothing held after.
  Every launch interpreted: --exhaustive only.
- Parallel ranks and an --artifact without the hidden states are refused before anything loads."""
import json
import sys

import numpy as np
import pytest

from exhaustive import EXHAUSTIVE
from infc.compiler.spec import SPECS_DIR
from infc.config import EngineConfig, speculative_config
from infc.runtime.engine.sampling import SamplingParams
from make_eagle3_head import write_head
from spec_rounds import same_drafts_each_round
from test_cuda_ranks import FakeCtx, FakeGraph, cuda_mods, fake_device, fake_launch  # noqa: F401
from test_spec_draft_cuda import _decode
from test_spec_eagle3 import target  # noqa: F401

H, V, VD = 64, 300, 120
LLAMA = str(SPECS_DIR / "llama.yaml")         # the tiny target's spec (transformers' Llama)


@pytest.fixture(scope="module")
def head(target, tmp_path_factory):  # noqa: F811
    """(head directory, its artifact: kernels rendered, no cubins)."""
    from infc.compiler.build import build
    from infc.compiler.spec import SPECS_DIR
    d, _ = target
    where = tmp_path_factory.mktemp("eagle-cuda")
    def spread(t):     # lm_head rows of growing norms: draft logits with clear maxima, no near-ties
        t["lm_head.weight"] *= np.exp(np.linspace(0, 3, VD, dtype=np.float32))[:, None]   # that bf16 flips
    h = write_head(d, where / "head", draft_vocab=VD, layers=[0, 2, 3], seed=3, edit=spread)
    art = build(model_dir=str(h), spec_path=str(SPECS_DIR / "eagle3.yaml"), out=where / "art", compile=False,
                log=None, check_checkpoint=False, page_size=16)
    return h, art


def _bf16(x):
    from infc.runtime.cuda.plan_io import from_bf16, to_bf16
    return from_bf16(to_bf16(x))


@EXHAUSTIVE
@pytest.mark.parametrize("rounds", [1, 2])
def test_the_head_on_the_cuda_runner_proposes_the_cpu_heads_drafts(fake_device, monkeypatch, head, rng, rounds):
    """Two sequences' catch-up (a prefill step) and chain (a decode step: the bucket's graph);
    with two rounds the rollback and the catch-up over the verified rows before the next chain."""
    from infc.compiler.build import compile_model
    from infc.compiler.contract.safetensors_io import Checkpoint
    from infc.compiler.spec import SPECS_DIR
    from infc.runtime.engine.runner import CPURunner
    from infc.runtime.engine.sequence import Sequence
    from infc.runtime.engine.speculative.eagle import EagleProposer
    from infc.runtime.weights.load import load_weights
    h, art = head
    monkeypatch.setattr(fake_device.runner, "Graph", FakeGraph)
    ctx = FakeCtx(8 << 20)
    embed = _bf16(rng.standard_normal((V, H)).astype(np.float32))     # the "target's" table
    table = ctx.alloc(embed.size * 2)
    ctx.put(table, embed, "bf16")
    gpu = fake_device.runner.CudaRunner(art, h, max_num_batched_tokens=24, max_num_seqs=2, num_pages=12,
                                        ctx=ctx, shared_weights={"embed": table}, buckets=[2])
    assert gpu.weights.ptr("embed", None) == table and gpu.inputs.keys() == {"aux", "hidden"}
    _, plan = compile_model(model_dir=str(h), spec_path=str(SPECS_DIR / "eagle3.yaml"), check_checkpoint=False)
    ckpt = Checkpoint(h)
    weights = load_weights(dict(plan, weights={k: v for k, v in plan["weights"].items() if k != "embed"}), ckpt)
    weights["embed"] = embed
    cpu = CPURunner(plan, weights, num_pages=12, page_size=16)
    d2t = ckpt.raw("d2t")
    props = [EagleProposer(r, d2t, 24, 256) for r in (cpu, gpu)]
    seen = [[], []]                                   # each head step's logits, per proposer
    for prop, log in zip(props, seen):
        prop._logits = lambda meta, f=prop._logits, log=log: log.append(np.array(f(meta))) or log[-1]
    params = SamplingParams(max_tokens=50, temperature=0)
    prompts = [list(map(int, rng.integers(0, V, n))) for n in (7, 4)]
    seqs = [[Sequence(i, f"r{i}", 0, list(p), params, 0) for i, p in enumerate(prompts)] for _ in props]
    aux = [rng.standard_normal((32, 3 * H)).astype(np.float32) for _ in range(2)]
    same_drafts_each_round(props, seqs, seen, aux, cpu, gpu, H, rounds, FakeGraph, logits_tol=2e-2)
    with pytest.raises(ValueError, match=r"step input 'aux' needs \[1, 192\] values"):
        from infc.runtime.engine.step import Chunk, build_step
        gpu.logits(build_step([Chunk(0, [1], 0)], lambda _: [0], 16))
    gpu.close()


# -- the backend's path: both runners on one fake device ------------------------------------------
@EXHAUSTIVE
def test_eagle3_on_the_cuda_runner_is_plain_decoding(fake_device, monkeypatch, target, head, tmp_path, rng):  # noqa: F811
    """load_backend's cuda path up to the runners (the builds into a temporary .cache): the
    target's artifact has aux_hidden, the head shares its embedding table, the caches split;
    then plain and EAGLE-3 decoding on the same target runner, greedy and seeded sampled."""
    import infc.compiler.build as build_mod
    from infc import backend
    from infc.runtime.engine.engine import Engine
    d, _ = target
    h, _ = head
    monkeypatch.setattr(build_mod, "REPO", tmp_path)
    monkeypatch.setattr(backend, "SERVED_ARTIFACTS", tmp_path / ".cache" / "artifacts")
    real_build = build_mod.build
    monkeypatch.setattr(build_mod, "build", lambda **kw: real_build(**dict(kw, compile=False)))
    monkeypatch.setattr(fake_device.runner, "Graph", FakeGraph)
    monkeypatch.setattr(sys.modules["infc.runtime.cuda.sampler"], "launch", fake_launch)
    ctx = FakeCtx(24 << 20)
    monkeypatch.setattr(fake_device.runner, "Context", lambda: ctx)
    spec = {"method": "eagle3", "model": str(h), "num_speculative_tokens": 3}
    c = backend.resolve(EngineConfig.from_settings(
        device="cuda", max_num_seqs=4, max_num_batched_tokens=24, block_size=16, gpu_memory_utilization=0.5,
        speculative_config=spec, spec=LLAMA))
    st = backend._Stages(None)
    capture = backend.eagle3_layers(c.speculative.speculative_config, d)
    art = build_mod.build(model_dir=str(d), spec_path=LLAMA, out=tmp_path / "target", page_size=16, log=None,
                          capture=capture)
    assert "aux_hidden" in json.loads((art / "plan.json").read_text())["outputs"]
    t, hr = backend._cuda_runners(st, c, art, d, backend._cuda_head_artifact(st, c, art), None,
                                  head=backend._cuda_head_weights)
    try:
        assert hr.weights.ptr("embed", None) == t.weights.ptr("embed", None)
        assert t.num_pages == hr.num_pages and hr.d2t.shape == (VD,)
        prompts = [rng.integers(0, V, n).tolist() for n in (11, 4)]
        params = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                  SamplingParams(max_tokens=5, temperature=0.9, top_k=40, seed=3, ignore_eos=True)]
        common = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=24)
        plain = _decode(Engine(t, **common), prompts, params)
        e = Engine(t, **common, draft_runner=hr, speculative_config=speculative_config(spec), overlap=True)
        assert t.can_overlap and not e.overlap         # speculating steps run synchronously
        got = _decode(e, prompts, params)
        assert got == plain and [len(got["r0"]), len(got["r1"])] == [6, 5]
        assert e.metrics.spec_decode_num_draft_tokens_total > 0 and e.spec.draft.forwards >= 2
        assert e.bm.num_free_pages == t.num_pages and e.spec.draft.held_pages() == 0
    finally:
        t.close()
        hr.close()


def test_what_eagle3_on_cuda_still_refuses(tmp_path):
    """Parallel ranks, and an --artifact built without the head's hidden states: refused before
    anything loads (config-only directories), saying why."""
    from infc import backend
    d = tmp_path / "target"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": V, "intermediate_size": 96,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-6}))
    h = write_head(d, tmp_path / "head", draft_vocab=VD, layers=[0, 2, 3])
    spec = {"method": "eagle3", "model": str(h), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match=r"with parallel ranks \(tensor, data or expert parallel\) is not supported"):
        backend.load_backend(d, EngineConfig.from_settings(device="cuda", tensor_parallel_size=2,
                                                           speculative_config=spec), log=None)
    art = tmp_path / "plain"                       # a plan without aux_hidden (only its outputs read)
    art.mkdir()
    (art / "plan.json").write_text(json.dumps({"outputs": {"logits": "logits.0"}}))
    with pytest.raises(ValueError, match="was built without the head's hidden states"):
        backend.load_backend(d, EngineConfig.from_settings(device="cuda", artifact=str(art),
                                                           speculative_config=spec), log=None)


def test_plan_inputs_go_up_and_outputs_come_back_by_their_rows():
    """runtime/cuda/plan_io.py without kernels: a step's inputs converted to their buffers'
    dtypes (bf16 bits, f32), padding rows zero, a missing one named; outputs read back lazily,
    each only when asked for, T- or B-rows of the step as the plan's shape says, bf16 widened."""
    from types import SimpleNamespace
    from infc.runtime.cuda.plan_io import StepOutputs, from_bf16, input_arrays, to_bf16
    plan = {"inputs": {"tokens": {"shape": ["T"], "dtype": "i32"}, "aux": {"shape": ["T", 3], "dtype": "bf16"},
                       "hidden": {"shape": ["T", 2], "dtype": "f32"}},
            "buffers": {"aux": {"shape": ["T", 3], "dtype": "bf16"}, "hidden": {"shape": ["T", 2], "dtype": "f32"},
                        "o1": {"shape": ["T", 3], "dtype": "f32"}, "o2": {"shape": ["B", 2], "dtype": "bf16"}},
            "outputs": {"logits": "lg", "rows": "o1", "last": "o2"}}
    rng = np.random.default_rng(3)
    aux, hid = rng.standard_normal((2, 3)).astype(np.float32), rng.standard_normal((2, 2)).astype(np.float32)
    got = input_arrays(plan, {"aux": aux, "hidden": hid}, 4, 2)
    assert got["aux"].dtype == np.uint16 and got["hidden"].dtype == np.float32
    assert np.array_equal(from_bf16(got["aux"][:2]), from_bf16(to_bf16(aux))) and not got["aux"][2:].any()
    assert np.abs(from_bf16(got["aux"][:2]) - aux).max() <= 1e-2 * np.abs(aux).max()
    assert np.array_equal(got["hidden"][:2], hid) and not got["hidden"][2:].any()
    assert not input_arrays(plan, None, 2, 0)["aux"].any()          # a padding step (graph capture)
    with pytest.raises(ValueError, match=r"step input 'hidden' needs \[2, 2\] values .* got none"):
        input_arrays(plan, {"aux": aux}, 2, 2)
    ctx, at = FakeCtx(1 << 16), {}
    o1, o2 = rng.standard_normal((5, 3)).astype(np.float32), rng.standard_normal((5, 2)).astype(np.float32)
    for name, a, dt in (("o1", o1, "f32"), ("o2", o2, "bf16")):
        at[name] = ctx.alloc(a.nbytes)
        ctx.put(at[name], a, dt)
    runner = SimpleNamespace(plan=plan, ctx=ctx, _buffer_ptr=at.__getitem__)
    out = StepOutputs(runner, {"T": 4, "B": 2})
    assert sorted(out) == ["last", "rows"] and "logits" not in out
    assert ctx.copies == 0 and not out.read
    assert np.array_equal(out["rows"], o1[:4]) and list(out.read) == ["rows"]
    assert np.array_equal(out["last"], from_bf16(to_bf16(o2[:2])))
    with pytest.raises(KeyError):
        out["aux_hidden"]
