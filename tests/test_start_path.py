"""`infc serve`'s start (issue 49, item 6): what its first imports pull in, and the build key that
lets a restarted server reuse its artifact without rebuilding the plan (compiler/build_key.py)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from infc.backend import _Stages, served_artifact
from infc.compiler import build_key
from infc.config import EngineConfig

# Imported only when first used: the compiler's graph and YAML libraries (a reused artifact needs
# neither), the chat templates' and structured outputs' libraries, the HTTP layer (imported beside
# the loading backend), and what the server never needs at all.
HEAVY = ("torch", "transformers", "triton", "fastapi", "pydantic", "yaml", "networkx", "jinja2",
         "llguidance", "starlette", "uvicorn", "prometheus_client", "scipy", "matplotlib")
# The HTTP layer itself (infc.server.app) may import its own libraries, never these.
NEVER = ("torch", "transformers", "triton", "fastapi", "pydantic", "yaml", "networkx", "scipy", "matplotlib")

PROBE = """
import json, sys
import infc.cli
from infc.server.serve import serve_main
from infc.server.args import config_from_args
config_from_args(infc.cli.parser().parse_args(["serve", "--model-path", "/m"]))   # before the load starts
import infc.backend
from infc.compiler import build_key, tuning_table
tuning_table.default_page_size("h200")
first = sorted({m.split(".")[0] for m in sys.modules})
import infc.server.app
print(json.dumps([first, sorted({m.split(".")[0] for m in sys.modules})]))
"""


def test_the_start_path_imports_nothing_heavy():
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    first, with_app = json.loads(r.stdout.splitlines()[-1])
    assert not set(HEAVY) & set(first), f"imported before first use: {sorted(set(HEAVY) & set(first))}"
    assert not set(NEVER) & set(with_app), f"the HTTP layer imports {sorted(set(NEVER) & set(with_app))}"
    assert "numpy" in first and "starlette" in with_app     # the probe saw the imports it counts


def test_the_build_key_names_what_a_rebuild_reads(tmp_path, monkeypatch):
    model, spec_dir = tmp_path / "m", tmp_path / "specs"
    model.mkdir()
    spec_dir.mkdir()
    (model / "config.json").write_text("{}")
    (spec_dir / "a.yaml").write_text("x: 1")
    key = lambda **kw: build_key.build_key({"gpu": "h200", **kw}, model, None, [str(spec_dir)])  # noqa: E731
    k0 = key()
    assert key() == k0 and key(gpu="h100") != k0
    st = (model / "config.json").stat()
    os.utime(model / "config.json", ns=(st.st_atime_ns, st.st_mtime_ns + 1000))
    k1 = key()
    assert k1 != k0                                         # a touched model file
    (spec_dir / "a.yaml").write_text("x: 2")
    k2 = key()
    assert k2 != k1                                         # a spec directory's file
    monkeypatch.setenv("INFC_OVERLAP", "0")
    assert key() != k2                                      # an INFC_ variable

    out = tmp_path / "art"
    (out / "bin").mkdir(parents=True)
    (out / "plan.json").write_text(json.dumps({"kernels": {"k1": {}}}))
    build_key.record(out, "abc")
    assert not build_key.matches(out, "abc")                # its cubin is missing
    (out / "bin" / "k1.cubin").write_bytes(b"x")
    assert build_key.matches(out, "abc") and not build_key.matches(out, "abd")
    (out / "plan.json").write_text(json.dumps({"kernels": {"k1": {}}, "x": 1}))
    assert not build_key.matches(out, "abc")                # another build rewrote the plan there
    build_key.record(out, "abc")
    build_key.forget(out)
    assert not build_key.matches(out, "abc")


def test_a_restarted_server_reuses_its_artifact_by_key(tmp_path, monkeypatch):
    """served_artifact: built once, reused while nothing changes, rebuilt after a change."""
    import infc.backend as backend
    import infc.compiler.build as build_mod
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text("{}")
    monkeypatch.setattr(backend, "SERVED_ARTIFACTS", tmp_path / "artifacts")
    monkeypatch.setattr(backend, "gpu_tuning", lambda: "h200")
    builds = []

    def fake_build(out, **kw):
        builds.append(kw)
        (Path(out) / "bin").mkdir(parents=True, exist_ok=True)
        (Path(out) / "plan.json").write_text(json.dumps({"kernels": {"k": {}}}))
        (Path(out) / "bin" / "k.cubin").write_bytes(b"x")
        return Path(out)
    monkeypatch.setattr(build_mod, "build", fake_build)
    c = EngineConfig.from_settings(device="cuda", block_size=64)
    logs, before = [], []
    run = lambda: served_artifact(_Stages(None), c, model, None, False, "auto", None, logs.append,  # noqa: E731
                                  before_build=lambda: before.append(len(builds)))
    a = run()
    assert a == tmp_path / "artifacts" / "tiny" and len(builds) == 1 and builds[0]["reuse_bins"]
    assert before == [0]                                      # the HTTP layer opens beside a build
    assert run() == a and len(builds) == 1 and "unchanged (its build key)" in logs[-1] and before == [0]
    (model / "model.safetensors").write_bytes(b"")            # the checkpoint changed
    assert run() == a and len(builds) == 2
    (a / "bin" / "k.cubin").unlink()                          # a cubin went missing
    assert run() == a and len(builds) == 3
    assert run() == a and len(builds) == 3


@pytest.mark.parametrize("fails", [False, True])
def test_a_stage_beside_logs_its_own_time_and_reraises(fails):
    logs = []
    st = _Stages(logs.append)

    def work():
        if fails:
            raise ValueError("bad tokenizer")
        return 7
    job = st.beside("load tokenizer (beside)", work)
    if fails:
        with pytest.raises(ValueError, match="bad tokenizer"):
            job.result()
    else:
        assert job.result() == 7 and st.done[0][0] == "load tokenizer (beside)" and "(beside)" in logs[0]


def test_the_tokenizer_thread_finds_the_longest_token_so_attach_does_not():
    """The prompt bound's vocabulary scan (0.1-0.2 s of GIL at 151k tokens) runs beside the
    weights, on the tokenizer's loading thread, not serially when the server attaches."""
    from smollm2_from_gguf import ensure_smollm2
    from infc.backend import _load_tokenizer
    from infc.server import protocol
    tok = _load_tokenizer(ensure_smollm2())
    longest = max(map(len, tok.tk.get_vocab(with_added_tokens=True)))

    class NoScan:                     # attach must not list the vocabulary again
        def __getattr__(self, name):
            if name == "get_vocab":
                raise AssertionError("the vocabulary scanned after the tokenizer's load")
            return getattr(real, name)
    real, tok.tk = tok.tk, NoScan()
    assert protocol.prompt_char_bound(tok, 128) == 128 * longest and longest > 1


def test_bench_startup_times_a_server_that_answers():
    """`infc bench startup`'s one start, on the CPU: ready (the first /health 200) after the
    server's `serving` line, then one completion; each log line kept with its time, and the GIL
    stalls (the tokenizer's load holds the GIL throughout: 0.2-0.3 s here for SmolLM2's)."""
    from smollm2_from_gguf import ensure_smollm2
    from infc.bench.startup import start_once
    r = start_once(str(ensure_smollm2()), ["--device", "cpu", "--max-model-len", "128", "--kv-cache-memory-bytes",
                                           str(32 << 20), "--uvicorn-log-level", "warning"], 0.0, 120.0, gil_watch=True)
    served = [t for t, line in r["timeline"] if line.startswith("serving ")]
    assert len(served) == 1 and served[0] <= r["ready_s"] < r["first_completion_s"], r["timeline"]
    assert [t for t, _ in r["timeline"]] == sorted(t for t, _ in r["timeline"])
    assert {"python start, infc imports", "load tokenizer (beside)", "attach to the server"} <= dict(r["stages"]).keys()
    assert r["idle_rss_mb"] > 50
    assert any(s > 0.05 and 0 < t < r["ready_s"] for t, s in r["gil_stalls"]), r["gil_stalls"]
