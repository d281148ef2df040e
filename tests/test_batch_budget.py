"""The step token budget when none is given: the server's 8k keeps decodes' gaps short, offline
work (LLM, bench throughput) takes 16k on the GPU (bench/NOTES.md, eighth session)."""
import pytest

from infc.backend import load_backend
from infc.config import default_batched_tokens


def test_the_offline_gpu_budget_is_larger_than_the_servers():
    assert default_batched_tokens("cuda", server=False) == 16384
    assert default_batched_tokens("cuda", server=True) == 8192
    assert default_batched_tokens("cpu", server=False) == default_batched_tokens("cpu", server=True) == 2048


@pytest.mark.parametrize("server", [False, True])
def test_an_engine_without_a_budget_takes_the_default(tiny_model, server):
    d, _ = tiny_model("qwen3")
    b = load_backend(d, device="cpu", asynchronous=server, log=None, max_model_len=64,
                     num_gpu_blocks_override=16)
    engine = b.engine.engine if server else b.engine
    assert engine.schedulers[0].max_num_batched_tokens == default_batched_tokens("cpu", server)
    b2 = load_backend(d, device="cpu", asynchronous=server, log=None, max_model_len=64,
                      num_gpu_blocks_override=16, max_num_batched_tokens=96)
    assert (b2.engine.engine if server else b2.engine).schedulers[0].max_num_batched_tokens == 96


def test_bench_throughput_leaves_the_budget_to_the_engine(monkeypatch, tmp_path):
    import infc.backend
    from infc.bench.throughput import main
    seen = {}

    def fake_load(*a, **kw):
        seen.update(kw)
        raise RuntimeError("stop here")
    monkeypatch.setattr(infc.backend, "load_backend", fake_load)
    with pytest.raises(RuntimeError, match="stop here"):
        main(["--model-path", str(tmp_path), "--concurrency", "1"])
    assert seen["max_num_batched_tokens"] is None
