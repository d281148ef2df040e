"""`infc bench prefix` on the CPU: a config-only tiny Qwen3 (--load-format dummy) with a small
word-level tokenizer, through the engine in-process and through a spawned `infc serve`. The JSON
has per-length cold and warm statistics, every warm request found its whole prefix (its full
pages) in the prefix cache and every cold one nothing, lengths past the model's context are
clipped with a note, and a warm request that misses the cache stops the benchmark."""
import importlib
import importlib.util
import itertools
import json
import os
import string
from pathlib import Path

import pytest

from infc.bench import prefix as bench

PNG = importlib.util.find_spec("matplotlib") is not None       # the plot is skipped without it

TINY = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=64, intermediate_size=96,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=300,
            max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True,
            bos_token_id=1, eos_token_id=2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """config.json (random weights: --load-format dummy) and a word-level tokenizer.json whose
    words are the ids 1..299 (id 0 is [UNK])."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    d = tmp_path_factory.mktemp("prefix-model") / "tiny-prefix"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(TINY))
    words = ["".join(p) for p in itertools.product(string.ascii_lowercase, repeat=2)][: TINY["vocab_size"] - 1]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["[UNK]"] + words)}, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.save(str(d / "tokenizer.json"))
    return d


@pytest.fixture
def small_cpu(monkeypatch):
    """One BLAS thread and a small KV cache, here and in a spawned server (shared cores)."""
    for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.setenv(k, "1")
    monkeypatch.setenv("INFC_CPU_KV_CACHE_BYTES", str(16 << 20))


def check_path(rec: dict, lengths: list[int], reps: int, cold_reps: int, new: int = 16):
    assert rec["lengths"] == lengths and list(rec["results"]) == [str(L) for L in lengths]
    for L in lengths:
        r = rec["results"][str(L)]
        assert r["expected_cached_tokens"] == L // 16 * 16 == L and r["prompt_tokens"] == L + new
        for mode, n, cached in (("cold", cold_reps, 0), ("warm", reps, L)):
            m = r[mode]
            assert m["n"] == n == len(m["samples_ms"]) == len(m["cached_tokens"]), (L, mode)
            assert m["cached_tokens"] == [cached] * n, (L, mode, m["cached_tokens"])   # the cache, checked
            assert 0 < m["p50_ms"] <= m["p99_ms"] <= max(m["samples_ms"]) + 1e-9
            assert min(m["samples_ms"]) <= m["mean_ms"] <= max(m["samples_ms"])


def test_cli_registers_bench_prefix(capsys):
    from infc.cli import parser
    a = parser().parse_args(["bench", "prefix", "--model-path", "M", "--path", "engine"])
    assert a.which == "prefix" and a.rest == ["--model-path", "M", "--path", "engine"]
    assert importlib.import_module(f"infc.bench.{a.which}").main is bench.main
    with pytest.raises(SystemExit) as e:
        bench.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--lengths", "--new-tokens", "--reps", "--cold-reps", "--path", "--load-format", "--out"):
        assert flag in out
    with pytest.raises(SystemExit) as e:
        bench.main(["--model-path", "M", "--load-format", "pt"])
    assert e.value.code == 2


def test_clip_lengths():
    assert bench.clip_lengths([1024, 4096, 16384, 32768], 16, 40960, 16) == ([1024, 4096, 16384, 32768], [])
    kept, notes = bench.clip_lengths([1024, 4096, 16384, 32768], 16, 8192, 16)
    assert kept == [1024, 4096, 8160] and len(notes) == 2 and "clipped to 8160" in notes[0]
    with pytest.raises(ValueError, match="shorter than one page"):
        bench.clip_lengths([8], 16, 8192, 16)


def test_engine_path_on_cpu(model_dir, tmp_path, small_cpu):
    res = bench.main(["--model-path", str(model_dir), "--load-format", "dummy", "--device", "cpu",
                      "--path", "engine", "--lengths", "32,64,1024", "--reps", "3", "--cold-reps", "2",
                      "--out", str(tmp_path)])
    path = tmp_path / "prefix-tiny-prefix-cpu.json"
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name] + [path.with_suffix(".png").name] * PNG
    saved = json.loads(path.read_text())
    assert saved == json.loads(json.dumps(res))
    for key in ("gpu", "commit", "date", "model", "load_format", "device", "settings", "paths"):
        assert key in saved, key
    assert saved["gpu"] == "cpu" and saved["load_format"] == "dummy" and list(saved["paths"]) == ["engine"]
    s = saved["settings"]
    assert s["lengths_requested"] == [32, 64, 1024] and s["new_tokens"] == 16 and s["reps"] == 3
    rec = saved["paths"]["engine"]
    assert rec["max_model_len"] == 256 and rec["page_size"] == 16 and rec["device"] == "cpu"
    top = (256 - 17) // 16 * 16                                   # 1024 + 16 + 1 do not fit in 256
    assert any(f"clipped to {top}" in n for n in rec["notes"])
    check_path(rec, [32, 64, top], reps=3, cold_reps=2)


def test_a_warm_miss_fails_loudly(model_dir, tmp_path, small_cpu, monkeypatch):
    import infc.backend
    argv = ["--model-path", str(model_dir), "--load-format", "dummy", "--device", "cpu", "--path", "engine",
            "--lengths", "32", "--reps", "2", "--out", str(tmp_path)]
    real = infc.backend.load_backend

    def no_cache(*a, **kw):                     # an engine without prefix caching: said up front
        return real(*a, **{**kw, "enable_prefix_caching": False})

    monkeypatch.setattr(infc.backend, "load_backend", no_cache)
    with pytest.raises(ValueError, match="without prefix caching"):
        bench.main(argv)

    def forgetful(*a, **kw):                    # caching on, but the cache never finds a block
        b = real(*a, **kw)
        b.engine.bm._cached_prefix = lambda seq: []
        return b

    monkeypatch.setattr(infc.backend, "load_backend", forgetful)
    with pytest.raises(RuntimeError, match="warm requests at L=32 found .* cached tokens, expected 32"):
        bench.main(argv)


def test_alternate_switches_a_flag_before_each_timed_request(model_dir, tmp_path, small_cpu, monkeypatch):
    """--alternate VAR: each request runs with VAR as its record says (0 / 1 in turn, the untimed
    warm-up hit 1), and each value's statistics are its own samples'."""
    import infc.backend
    import numpy as np
    real, seen = infc.backend.load_backend, []

    def spying(*a, **kw):
        b = real(*a, **kw)
        add = b.engine.add_request
        b.engine.add_request = lambda prompt, *r, **k: (seen.append((len(prompt), os.environ.get("INFC_SHORT_GRAPHS"))),
                                                         add(prompt, *r, **k))[1]
        return b

    monkeypatch.setattr(infc.backend, "load_backend", spying)
    monkeypatch.delenv("INFC_SHORT_GRAPHS", raising=False)
    res = bench.main(["--model-path", str(model_dir), "--load-format", "dummy", "--device", "cpu",
                      "--path", "engine", "--lengths", "32", "--reps", "5", "--cold-reps", "3",
                      "--alternate", "INFC_SHORT_GRAPHS", "--out", str(tmp_path)])
    rec = res["paths"]["engine"]
    assert rec["alternate"] == "INFC_SHORT_GRAPHS"
    check_path(rec, [32], reps=5, cold_reps=3)
    r = rec["results"]["32"]
    # the first request (the engine's first step) is not the sweep's; then: untimed cold, 3 cold,
    # the prefix, the untimed warm hit, 5 warm
    assert [v for _, v in seen[1:]] == list("1010" + "0" + "1" + "01010"), seen
    for mode, want in (("cold", [0, 1, 0]), ("warm", [0, 1, 0, 1, 0])):
        m = r[mode]
        assert m["variants"] == want
        for v, st in m["by_variant"].items():
            mine = [t for t, w in zip(m["samples_ms"], m["variants"]) if w == int(v)]
            assert st["n"] == len(mine) and st["p50_ms"] == pytest.approx(float(np.percentile(mine, 50)))
    for bad in (["--alternate", "INFC_NOT_A_VARIABLE"], ["--alternate", "INFC_CACHE"],
                ["--alternate", "INFC_SHORT_GRAPHS", "--path", "both"]):
        with pytest.raises(SystemExit) as e:
            bench.main(["--model-path", str(model_dir), "--load-format", "dummy", "--device", "cpu",
                        "--path", "engine", *bad])
        assert e.value.code == 2, bad


def test_serve_path_against_infc_serve_on_cpu(model_dir, tmp_path, small_cpu):
    res = bench.main(["--model-path", str(model_dir), "--load-format", "dummy", "--device", "cpu",
                      "--path", "serve", "--lengths", "32,64", "--reps", "3", "--cold-reps", "2",
                      "--timeout-s", "120", "--out", str(tmp_path), "--", "--max-num-seqs", "4"])
    saved = json.loads((tmp_path / "prefix-tiny-prefix-cpu.json").read_text())
    assert (tmp_path / "prefix-tiny-prefix-cpu.png").exists() == PNG and list(saved["paths"]) == ["serve"]
    rec = saved["paths"]["serve"]
    assert rec["prompt_format"] == "text"               # the tokenizer runs in the server
    assert "--max-num-seqs" in rec["serve_args"] and "--load-format" in rec["serve_args"]
    assert rec["max_model_len"] == 256 and rec["notes"] == []
    check_path(rec, [32, 64], reps=3, cold_reps=2)
    assert all(r["tokenize_ms"] > 0 for r in rec["results"].values())      # text: its tokenizer's share
    assert res["paths"]["serve"]["results"]["64"]["warm"]["cached_tokens"] == [64] * 3


def test_text_prompts_keep_their_prefix(model_dir):
    import numpy as np
    from infc.runtime.tokenization.tokenizer import Tokenizer
    tok = Tokenizer(Path(model_dir))
    p = bench.TextPrompts(tok, np.random.default_rng(0))
    prefix = p.make(48)
    full = prefix + p.make(16, start=False)
    p.check_prefix(prefix, full, 48, 64)
    assert tok.encode(full)[:48] == tok.encode(prefix) and len(tok.encode(full)) == 64


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_engine_path_from_a_kv_tier_on_cpu(model_dir, tmp_path, small_cpu, tier):
    """--tier host|disk: every warm hit restored from that tier (checked per request by the
    benchmark itself), its copies' time and bandwidth recorded beside the TTFTs."""
    res = bench.main(["--model-path", str(model_dir), "--load-format", "dummy", "--device", "cpu",
                      "--path", "engine", "--lengths", "32,64", "--reps", "2", "--cold-reps", "1",
                      "--tier", tier, "--kv-offloading-size", "0.01", "--out", str(tmp_path)])
    rec = res["paths"]["engine"]
    assert res["settings"]["tier"] == tier == rec["tier"]
    assert (tmp_path / f"prefix-{tier}-tiny-prefix-cpu.json").exists()
    check_path(rec, [32, 64], reps=2, cold_reps=1)
    for L in (32, 64):
        w = rec["results"][str(L)]["warm"]
        assert len(w["restore_ms"]) == 2 and all(ms > 0 for ms in w["restore_ms"])
        assert w["restore_bytes"] > 0 and w["restore_GBps"] > 0
    with pytest.raises(SystemExit):
        bench.main(["--model-path", str(model_dir), "--tier", "host", "--path", "both"])


@pytest.mark.parametrize("eager", [False, True])
def test_hbm_hits_with_the_tier_on_on_cpu(model_dir, tmp_path, small_cpu, monkeypatch, eager):
    """--tier hbm with --kv-offloading-size: every warm hit still comes from the device's pages
    (nothing restored), in a file apart from a tier-off run's; the KV cache has room, so the
    tier saves nothing (write-back) unless INFC_KV_SAVE_EAGER=1 saves every finished request."""
    if eager:
        monkeypatch.setenv("INFC_KV_SAVE_EAGER", "1")
    res = bench.main(["--model-path", str(model_dir), "--load-format", "dummy", "--device", "cpu",
                      "--path", "engine", "--lengths", "32,64", "--reps", "2", "--cold-reps", "1",
                      "--kv-offloading-size", "0.01", "--settle-s", "0.01", "--out", str(tmp_path)])
    rec = res["paths"]["engine"]
    assert rec["tier"] == "hbm" and rec["kv_offloading_size_gib"] == 0.01 and res["settings"]["settle_s"] == 0.01
    assert (tmp_path / "prefix-tier-on-tiny-prefix-cpu.json").exists()
    check_path(rec, [32, 64], reps=2, cold_reps=1)
    assert (rec["tier_bytes"]["to_host"] > 0) == eager and rec["tier_bytes"]["to_device"] == 0
    assert bench.tier_pool_gib("hbm", None) is None and bench.tier_pool_gib("host", None) == bench.TIER_POOL_GIB


def test_the_server_trace_follows_each_warm_request_through_the_server(model_dir, tmp_path, small_cpu):
    """--trace-server (bench/server_trace.py): each warm request's marks inside the spawned server,
    every one of them, in the order a request passes them, all after the client's send and before
    its first token; the engine has the request before the loop takes it back from the pool."""
    from infc.bench.server_trace import BESIDE, ORDER
    bench.main(["--model-path", str(model_dir), "--load-format", "dummy", "--device", "cpu",
                "--path", "serve", "--lengths", "32", "--reps", "3", "--cold-reps", "1", "--trace-server",
                "--timeout-s", "120", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "prefix-tiny-prefix-cpu.json").read_text())
    b = saved["paths"]["serve"]["results"]["32"]["server_trace_ms"]
    assert list(b) == list(ORDER) + ["first"] + list(BESIDE), b
    path = [b[n] for n in list(ORDER) + ["first"]]
    assert 0 < b["conn"] and all(x <= y for x, y in zip(path, path[1:])), b
    assert b["send"] <= b["pool<"] <= b["first"], b
    assert b["first"] == pytest.approx(saved["paths"]["serve"]["results"]["32"]["warm"]["p50_ms"], abs=1e-3)


def test_the_server_trace_breakdown_takes_each_requests_first_pass():
    """breakdown: a mark's time is the first within each request's span, as ms after its send;
    medians over the spans; a mark seen in fewer than half of them is left out."""
    from infc.bench.server_trace import breakdown
    marks = [(1.0001, "conn"), (1.0020, "step>"), (1.0030, "step>"), (1.0100, "chunk"),
             (2.0002, "conn"), (2.0040, "step>"), (2.0200, "chunk"), (2.0210, "put"),
             (3.0003, "conn"), (3.0050, "step>"), (3.0150, "chunk"), (5.0, "add")]
    spans = [(1.0, 1.011), (2.0, 2.0205), (3.0, 3.016)]
    b = breakdown(marks, spans)
    assert b == {"conn": pytest.approx(0.2), "step>": pytest.approx(4.0), "chunk": pytest.approx(15.0),
                 "first": pytest.approx(16.0)}
