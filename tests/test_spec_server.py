"""Speculative decoding served: `infc serve --speculative-config` (vLLM's JSON) accepted, shown at
startup and used, a malformed one refused before anything loads with a message naming what is
wrong, `infc generate` taking the same flag, and vLLM's spec_decode counters in /metrics (only
when the engine speculates, as vLLM shows them)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from infc.cli import parser
from infc.config import EngineConfig, SpeculativeConfig, speculative_config
from infc.server.args import backend_kwargs, config_from_args, engine_config
from infc.server.metrics import render
from infc.runtime.engine.metrics import Metrics
from test_server_support import one_blas_thread, request, serve_process  # noqa: F401

ROOT = Path(__file__).resolve().parent.parent
NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}'


def parse(*argv):
    return parser().parse_args(["serve", "--model-path", "/m", *argv])


def test_the_flag_reaches_the_engine_config():
    a = parse("--speculative-config", NGRAM, "--device", "cpu")
    assert backend_kwargs(a)["speculative_config"] == NGRAM
    config_from_args(a)
    c = engine_config(a).resolved(lambda: "cpu", lambda: 16)
    assert c.speculative.speculative_config == SpeculativeConfig("ngram", 3, 2, 4)
    assert engine_config(parse()).resolved(lambda: "cpu", lambda: 16).speculative.speculative_config is None
    g = parser().parse_args(["generate", "--model-path", "/m", "--prompt", "x", "--speculative-config", NGRAM])
    assert g.speculative_config == NGRAM
    flat = EngineConfig.from_settings(speculative_config={"method": "[ngram]", "num_speculative_tokens": 2})
    assert flat.resolved(lambda: "cpu", None).speculative.speculative_config == SpeculativeConfig("ngram", 2)
    draft = '{"method": "draft_model", "model": "qwen3-0.6b", "num_speculative_tokens": 5}'
    c = engine_config(parse("--speculative-config", draft)).resolved(lambda: "cpu", lambda: 16)
    assert c.speculative.speculative_config == SpeculativeConfig("draft_model", 5, model="qwen3-0.6b")


@pytest.mark.parametrize("value,message", [
    ("{method: ngram}", r"--speculative-config is not valid JSON"),
    ("[1, 2]", r"must be a JSON object, got list"),
    ('{"method": "ngram"}', r"'num_speculative_tokens' is required"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', r"'num_speculative_tokens' must be an integer >= 1, got 0"),
    ('{"method": "ngram", "num_speculative_tokens": 2.5}', r"'num_speculative_tokens' must be an integer"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}',
     r"'prompt_lookup_max' \(2\) must be >= 'prompt_lookup_min' \(4\)"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}', r"unknown key 'lookahead'"),
    ('{"method": "eagle", "num_speculative_tokens": 2, "model": "x"}', r"method 'eagle' is not supported yet"),
    ('{"method": "eagle3", "num_speculative_tokens": 2}', r"method 'eagle3' needs 'model'"),
    ('{"method": "eagle3", "num_speculative_tokens": 2, "model": "h", "prompt_lookup_min": 2}',
     r"'prompt_lookup_min' is for method 'ngram'"),
    ('{"method": "draft_model", "num_speculative_tokens": 2}', r"method 'draft_model' needs 'model'"),
    ('{"method": "draft_model", "num_speculative_tokens": 2, "model": "d", "prompt_lookup_max": 3}',
     r"'prompt_lookup_max' is for method 'ngram'"),
    ('{"method": "mtp", "num_speculative_tokens": 1, "model": "d"}', r"method 'mtp' takes no 'model'"),
    ('{"method": "deepseek_mtp", "num_speculative_tokens": 1, "prompt_lookup_min": 2}',
     r"'prompt_lookup_min' is for method 'ngram'; 'mtp' takes none"),
    ('{"method": "medium", "num_speculative_tokens": 1}', r"unknown method 'medium'"),
    ('{"num_speculative_tokens": 1}', r"'method' is required"),
    ('{"method": ["ngram"], "num_speculative_tokens": 1}', r"'method' must be a string .*got \['ngram'\]"),
    ('{"method": {"name": "ngram"}, "num_speculative_tokens": 1}', r"'method' must be a string"),
    ('{"method": "draft_model", "num_speculative_tokens": 1, "model": ["d"]}', r"'model' must be a string"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "model": "x"}', r"'model' is for a draft model"),
])
def test_malformed_configs_are_refused_by_name(value, message):
    with pytest.raises(ValueError, match=message):
        speculative_config(value)
    with pytest.raises(ValueError, match=message):
        config_from_args(parse("--speculative-config", value))


def test_lookup_bounds_default_as_vllms():
    assert speculative_config({"method": "ngram", "num_speculative_tokens": 2}).prompt_lookup_min == 5
    c = speculative_config({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (3, 3)
    c = speculative_config({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (2, 2)


def test_serve_refuses_a_malformed_config_before_loading(tmp_path):
    r = subprocess.run([sys.executable, "-m", "infc.cli", "serve", "--model-path", str(tmp_path), "--port", "0",
                        "--speculative-config", '{"method": "ngram", "num_speculative_tokens": -1}'],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2, r.stderr[-500:]
    assert "'num_speculative_tokens' must be an integer >= 1, got -1" in r.stderr, r.stderr[-500:]


def test_metrics_render_only_when_speculating():
    m = Metrics()
    assert "spec_decode" not in render(vars(m), "x")
    m.spec_decode_positions = 3
    m.drafts_verified(3, 2)
    m.drafts_verified(2, 0)
    text = render(vars(m), "x")
    assert 'vllm:spec_decode_num_drafts_total{model_name="x"} 2.0' in text
    assert 'vllm:spec_decode_num_draft_tokens_total{model_name="x"} 5.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_total{model_name="x"} 2.0' in text
    assert "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter" in text
    for j, v in enumerate((1.0, 1.0, 0.0)):
        assert f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="x",position="{j}"}} {v}' in text


def test_served_with_speculation_metrics_after_a_request():
    from smollm2_from_gguf import ensure_smollm2
    with serve_process(ensure_smollm2(), "--max-model-len", "256", "--kv-cache-memory-bytes", str(32 << 20),
                       "--speculative-config", NGRAM, "--uvicorn-log-level", "warning") as (port, out):
        assert "speculative decoding: ngram, 3 draft tokens (prompt lookup 2..4)" in out, out
        text = "The cat sat on the mat. The dog sat on the log. " * 3
        s, _, body = request(port, "POST", "/v1/completions",
                             {"prompt": "Repeat exactly: " + text + "\nRepeat: The cat sat", "max_tokens": 24,
                              "temperature": 0})
        assert s == 200 and json.loads(body)["usage"]["completion_tokens"] >= 1
        s, _, metrics = request(port, "GET", "/metrics")
        metrics = metrics.decode()
        values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                  if line.startswith("vllm:spec_decode") and "position" not in line}
        assert values["vllm:spec_decode_num_drafts_total"] > 0
        assert values["vllm:spec_decode_num_accepted_tokens_total"] > 0
        assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name=' in metrics
