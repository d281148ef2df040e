"""A LoRA artifact on the CUDA runner, on the fake device (tests/test_cuda_ranks.py's: host
memory, kernels under the Triton interpreter, graphs replayed by re-issuing): the adapters written
into the device tables (runtime/cuda/lora_tables.py) and the per-token lora_slots uploaded with
every step, decode graphs captured once, serve the CPU runner's greedy tokens."""
import sys

import pytest

from infc.compiler.build import build, compile_model
from infc.compiler.contract.safetensors_io import Checkpoint
from infc.config import lora_build
from infc.runtime.engine.engine import Engine
from infc.runtime.engine.runner import CPURunner
from infc.runtime.engine.sampling import SamplingParams
from infc.runtime.weights.load import load_weights

from make_lora_adapter import make_adapter
from test_cuda_ranks import FakeCtx, FakeGraph, cuda_mods, fake_device, fake_launch  # noqa: F401

LORA = lora_build(2, 16)


@pytest.fixture(scope="module")
def artifact(tiny_model, tmp_path_factory):
    d, _ = tiny_model("qwen3")
    out = tmp_path_factory.mktemp("lora-qwen3")
    build(model_dir=str(d), out=out, compile=False, log=None, lora=LORA)
    for i, n in enumerate("ab"):
        make_adapter(d, out / "adapters" / n, rank=(16, 8)[i], alpha=16, seed=20 + i)
    return d, out


def _tokens(engine, root) -> dict:
    for n in "ab":
        engine.loras.register(n, root / n)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    for i, (p, lora) in enumerate([([5, 17, 200, 3, 9, 44, 21], "a"), ([8, 8, 120, 77, 6], None),
                                   ([5, 17, 200, 3, 9, 44, 21], "b")]):
        engine.add_request(p, params, f"r{i}", lora=lora)
    out: dict = {}
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.token_ids)
    return out


def test_cuda_runner_serves_the_cpu_runners_lora_tokens(fake_device, artifact, monkeypatch):
    d, art = artifact
    monkeypatch.setattr(fake_device.runner, "Graph", FakeGraph)
    monkeypatch.setattr(sys.modules["infc.runtime.cuda.sampler"], "launch", fake_launch)
    r = fake_device.runner.CudaRunner(art, d, max_num_batched_tokens=24, max_num_seqs=4,
                                      num_pages=24, buckets=[1, 2, 4], ctx=FakeCtx(40 << 20))
    replays = FakeGraph.replays
    got = _tokens(Engine(r, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=24, overlap=False),
                  art / "adapters")
    assert FakeGraph.replays > replays                  # decode steps ran from graphs
    r.close()
    _, plan = compile_model(model_dir=d, lora=LORA)
    cpu = CPURunner(plan, load_weights(plan, Checkpoint(d)), 24)
    want = _tokens(Engine(cpu, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=24),
                   art / "adapters")
    assert got == want
    assert got["r0"] != got["r2"]                       # same prompt, other adapter
