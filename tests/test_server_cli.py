"""`infc serve` and `infc bench serve`: vLLM's flag spellings and defaults, unknown and abbreviated
flags rejected, the real command starting on 127.0.0.1 (stages with timings, KV capacity, maximum
concurrency, /health), and the serving benchmark against a live server writing its JSON."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from infc.cli import parser
from infc.server.args import backend_kwargs, config_from_args
from test_server_support import one_blas_thread, request, serve_process, srv  # noqa: F401

ROOT = Path(__file__).resolve().parent.parent


def parse(*argv):
    return parser().parse_args(["serve", "--model-path", "/m", *argv])


def test_serve_flags_and_defaults(monkeypatch):
    a = parse()
    # no --block-size: the backend takes the device's (16 on cpu; on cuda the build's for the GPU)
    assert (a.host, a.port, a.gpu_memory_utilization, a.max_num_seqs, a.block_size) == ("127.0.0.1", 8000, 0.9, 256, None)
    from infc.backend import device_page_size as default_block_size
    assert default_block_size("cpu") == 16
    assert a.enable_prefix_caching is True and a.device is None and a.max_model_len is None
    assert a.max_num_batched_tokens is None and a.served_model_name is None and a.max_logprobs == 20
    a = parse("--no-enable-prefix-caching", "--served-model-name", "a", "b", "--max-model-len", "512",
              "--device", "cpu", "--max-num-batched-tokens", "64", "--api-key", "k", "--port", "0")
    assert a.enable_prefix_caching is False and a.served_model_name == ["a", "b"] and a.max_model_len == 512
    kw = backend_kwargs(a)
    assert kw["enable_prefix_caching"] is False and kw["max_num_batched_tokens"] == 64 and kw["device"] == "cpu"
    assert kw["overlap"] is None and backend_kwargs(parse("--disable-overlap-schedule"))["overlap"] is False
    cfg = config_from_args(a)
    assert cfg.served_model_names == ["a", "b"] and cfg.api_key == "k"
    monkeypatch.setenv("INFC_API_KEY", "from-env")
    assert config_from_args(parse()).api_key == "from-env"
    assert config_from_args(parse()).served_model_names == ["/m"]
    assert config_from_args(parse("--model", "smollm2-135m")).served_model_names == ["smollm2-135m"]
    for bad in (["--foo"], ["--max-model", "5"], ["--served-model", "x"], ["--device", "tpu"],
                ["--enable-prefix-caching=1"]):
        with pytest.raises(SystemExit) as e:
            parse(*bad)
        assert e.value.code == 2, bad
    with pytest.raises(SystemExit):
        parser().parse_args(["serve"])                       # --model-path is required
    assert parser().parse_args(["bench", "serve", "--rates", "1"]).which == "serve"


def test_serve_command_starts_and_reports(tmp_path):
    from smollm2_from_gguf import ensure_smollm2
    with serve_process(ensure_smollm2(), "--max-model-len", "128", "--kv-cache-memory-bytes", str(32 << 20),
                       "--served-model-name", "tiny", "--uvicorn-log-level", "warning") as (port, out):
        for stage in ("python start, infc imports", "HTTP layer imports (beside)", "compile plan", "load weights",
                      "allocate KV cache", "load tokenizer (beside)", "start engine", "attach to the server"):
            assert stage in out and "s\n" in out, out
        from infc.compiler.build import compile_model
        from infc.runtime.engine.runner import CPURunner
        _, plan = compile_model(model_dir=str(ensure_smollm2()))
        pages = CPURunner.pages_for_budget(plan, 16, 32 << 20)     # compiler/contract/caches.py's arithmetic
        assert pages >= 40                                         # 45 float32 K+V pages less the padding page
        assert f"KV cache: {pages} pages x 16 tokens = {pages * 16} tokens (bf16); max model len 128" in out
        assert f"maximum concurrency for 128 tokens per request: {pages * 16 / 128:.2f}x" in out
        assert out.splitlines()[-1].strip() == f"serving tiny at http://127.0.0.1:{port}"
        assert request(port, "GET", "/health")[0] == 200
        s, _, body = request(port, "POST", "/v1/completions", {"model": "tiny", "prompt": "Hi", "max_tokens": 1})
        assert s == 200 and json.loads(body)["usage"]["completion_tokens"] == 1


def test_serve_command_fails_loudly(tmp_path):
    r = subprocess.run([sys.executable, "-m", "infc.cli", "serve", "--model-path", str(tmp_path / "absent"),
                        "--port", "0"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2 and "not a directory" in r.stderr, r.stderr[-500:]
    # a bad INFC_HTTP_PARSER / INFC_EVENT_LOOP is named, without a traceback
    for var, val in (("INFC_HTTP_PARSER", "picohttp"), ("INFC_EVENT_LOOP", "trio")):
        r = subprocess.run([sys.executable, "-m", "infc.cli", "serve", "--model-path", str(tmp_path / "absent"),
                            "--port", "0"], capture_output=True, text=True, timeout=120, cwd=ROOT,
                           env={**os.environ, var: val})
        assert r.returncode == 2 and f"{var}={val!r}" in r.stderr and "Traceback" not in r.stderr, r.stderr[-500:]


def test_bench_serve_against_live_server(srv, tmp_path):
    from infc.bench import serve as bench
    res = bench.main(["--base-url", srv.url + "/v1", "--rates", "20,inf", "--num-prompts", "3", "--input-len", "8",
                      "--output-len", "3", "--out", str(tmp_path), "--gpu", "cpu test"])
    files = list(tmp_path.glob("serve-*.json"))
    assert [f.name for f in files] == ["serve-smol-cpu-test.json"]
    saved = json.loads(files[0].read_text())
    assert saved["model"] == "smol" and saved["input_len"] == 8 and len(saved["results"]) == 2
    for r in res["results"]:
        assert r["completed"] == 3 and r["failed"] == 0, r
        for key in ("ttft", "tpot", "itl", "e2e"):
            assert {"mean_ms", "p50_ms", "p90_ms", "p99_ms"} <= set(r[key]), key
        assert r["output_throughput"] > 0 and r["ttft"]["p99_ms"] >= r["ttft"]["p50_ms"] > 0
    assert saved["results"][1]["request_rate"] == "inf"
