"""The `infc` command: build and inspect output, and user errors that exit 2 without a traceback."""
import json
import os
import re
import subprocess
import sys

import pytest

from infc.cli import main


@pytest.fixture(autouse=True)
def _no_debug(monkeypatch):
    monkeypatch.delenv("INFC_DEBUG", raising=False)


def test_build_prints_timed_stages_and_writes_plan(tmp_path, capsys):
    assert main(["build", "--model", "qwen3-4b", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    timed = [l for l in out.splitlines() if re.search(r"\d+\.\d ms$", l)]
    for stage in ("parse + validate spec", "bind config", "pass lower", "pass infer_types",
                  "pass plan_memory", "pass select_kernels", "emit plan", "write "):
        assert any(stage in l for l in timed), (stage, out)
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan


def test_unknown_flag_exits_2_without_traceback(tmp_path):
    r = subprocess.run([sys.executable, "-m", "infc.cli", "build", "--model", "qwen3-4b",
                        "--no-such-flag"], capture_output=True, text=True, cwd=tmp_path,
                       timeout=120, env={k: v for k, v in os.environ.items() if k != "INFC_DEBUG"})
    assert r.returncode == 2
    assert "unrecognized arguments: --no-such-flag" in r.stderr
    assert "Traceback" not in r.stderr + r.stdout


def test_unknown_flag_in_process():
    with pytest.raises(SystemExit) as e:
        main(["inspect", "qwen3-4b", "--bogus"])
    assert e.value.code == 2


def test_no_model_named(capsys):
    assert main(["build"]) == 2
    err = capsys.readouterr().err
    assert "name a model (--model NAME) or a model directory" in err
    assert "Traceback" not in err


def test_inspect_decode_launches_per_layer(capsys):
    assert main(["inspect", "qwen3-4b", "--phase", "decode"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"launches: decode\s+\(8 per layer", out), out


def test_inspect_wide_phase(capsys):
    """The wide program (decode steps of many sequences) is listed like any phase: a model with
    experts runs them grouped there, a dense one only its GEMVs' row tiles differ."""
    assert main(["inspect", "qwen3-30b-a3b", "--phase", "wide"]) == 0
    out = capsys.readouterr().out
    assert "== launches: wide  (10 per layer" in out and "triton:moe_gate_up_grouped" in out
    assert "== launches: decode" not in out
    assert main(["inspect", "qwen3-4b", "--phase", "wide"]) == 0
    out = capsys.readouterr().out
    assert "== launches: wide  (" in out and "triton:gemv_gated" in out and "triton:lm_head_last" in out
    assert "per step; decode steps of >= 128 sequences)" in out
    assert "== launches: decode" not in out and "moe_" not in out


def test_inspect_verify_phase(capsys, tiny_model, monkeypatch):
    """A speculative build's verify program (--speculative-config: k + 1 rows, INFC_VERIFY_PROGRAM)
    is listed like any phase."""
    monkeypatch.setenv("INFC_VERIFY_PROGRAM", "1")
    d, _ = tiny_model("qwen3")
    spec = '{"method": "ngram", "num_speculative_tokens": 4}'
    assert main(["inspect", "--model-path", str(d), "--phase", "verify", "--speculative-config", spec]) == 0
    out = capsys.readouterr().out
    assert re.search(r"== launches: verify  \(5 per layer, \d+ per step; decode steps of 2-5 tokens", out), out


def test_inspect_writes_dot(tmp_path, capsys):
    dot = tmp_path / "f.dot"
    assert main(["inspect", "qwen3-4b", "--dot", str(dot)]) == 0
    capsys.readouterr()
    assert dot.read_text().startswith("digraph")


def test_model_dir_without_config_json(tmp_path, capsys):
    assert main(["build", "--model-path", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path}: no config.json" in err
    assert "Traceback" not in err


def test_config_json_with_invalid_json(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{\n  "hidden_size": 64,\n  "vocab_size": ,\n}\n')
    assert main(["inspect", "--model-path", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'config.json'}:3: invalid JSON" in err, err
    assert "Traceback" not in err


def test_config_json_of_unknown_architecture(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"architectures": ["MambaForCausalLM"]}')
    assert main(["build", "--model-path", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "MambaForCausalLM" in err and "Traceback" not in err


def test_config_json_missing_a_key(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64}')
    assert main(["build", "--model-path", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert re.search(r"qwen3\.yaml:\d+: config key '\w+' \(symbol \w+\) is missing in .*config\.json", err), err
