"""Multi-LoRA serving as vLLM does it, over the CPU backend: `--enable-lora --lora-modules
name=path`, a request picks an adapter by `model`, /v1/models lists adapters with their parent,
POST /v1/load_lora_adapter and /v1/unload_lora_adapter behind --allow-runtime-lora-updating; a
bad adapter is a 400 naming what is wrong, nothing is loaded and the others keep serving."""
import json
import re

import pytest

from infc.backend import load_backend
from infc.server.app import ServerConfig

from make_lora_adapter import make_adapter
from test_server_support import Live, request, run_together, tiny_qwen3_dir, wait_idle

PROMPT = [785, 6722, 315, 9625, 374, 264, 3283]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tiny_qwen3_dir(tmp_path_factory.mktemp("qwen3-lora"), seed=7, max_len=256)
    adapters = tmp_path_factory.mktemp("adapters")
    for i, (name, rank) in enumerate([("a", 8), ("b", 16), ("big", 32)]):
        make_adapter(d, adapters / name, rank=rank, alpha=2 * rank, seed=i, std=0.3)
    b = load_backend(d, device="cpu", max_model_len=256, max_num_seqs=8, enable_lora=True, max_loras=2,
                     max_lora_rank=16, lora_modules={"a": str(adapters / "a")}, log=None)
    live = Live(b, ServerConfig(served_model_names=["base"], allow_runtime_lora_updating=True))
    yield live, adapters
    live.stop()
    b.engine.shutdown()


def _complete(live, model, **kw):
    status, _, body = request(live.port, "POST", "/v1/completions",
                              {"model": model, "prompt": PROMPT, "max_tokens": 5, "temperature": 0,
                               "logprobs": 2, **kw})
    return status, json.loads(body)


def _answer(live, model):
    status, body = _complete(live, model)
    assert status == 200, body
    lp = body["choices"][0]["logprobs"]
    return lp["tokens"], lp["token_logprobs"]


def _models(live):
    status, _, body = request(live.port, "GET", "/v1/models")
    assert status == 200
    return {m["id"]: m for m in json.loads(body)["data"]}


def test_an_adapter_is_a_model_with_the_base_as_parent_and_serves_as_alone(setup):
    live, adapters = setup
    models = _models(live)
    assert models["base"]["parent"] is None
    assert models["a"]["parent"] == "base" and models["a"]["root"] == str(adapters / "a")
    alone = {m: _answer(live, m) for m in ("base", "a")}
    assert alone["a"][0] != alone["base"][0]                     # the adapter changes the answer
    together = run_together([lambda m=m: _answer(live, m) for m in ("a", "base", "a", "base")], 300)
    for (tokens, lps), m in zip(together, ("a", "base", "a", "base")):
        # the same tokens; logprobs to float32 rounding (a batch sums in another order)
        assert tokens == alone[m][0] and max(abs(x - y) for x, y in zip(lps, alone[m][1])) < 1e-4
    wait_idle(live.engine)
    assert not any(live.engine.loras.holders.values())
    status, _, body = request(live.port, "GET", "/metrics")
    assert status == 200 and re.search(r'^vllm:lora_requests_info\{max_lora="2",running_lora_adapters="",'
                                       r'waiting_lora_adapters=""\} \d', body.decode(), re.M)


def test_load_and_unload_at_run_time(setup):
    live, adapters = setup
    status, _, body = request(live.port, "POST", "/v1/load_lora_adapter",
                              {"lora_name": "b", "lora_path": str(adapters / "b")})
    assert status == 200, body
    assert _models(live)["b"]["parent"] == "base"
    b = _answer(live, "b")
    assert b != _answer(live, "a")
    status, _, body = request(live.port, "POST", "/v1/unload_lora_adapter", {"lora_name": "b"})
    assert status == 200, body
    assert "b" not in _models(live)
    status, body = _complete(live, "b")
    assert status == 404 and body["error"]["code"] == "model_not_found"
    status, _, body = request(live.port, "POST", "/v1/unload_lora_adapter", {"lora_name": "b"})
    assert status == 404 and b"'b' is not loaded" in body


@pytest.mark.parametrize("body,status,message", [
    ({"lora_name": "x", "lora_path": "/nonexistent/adapter"}, 400, "no such directory"),
    ({"lora_name": "base", "lora_path": "ADAPTERS/b"}, 400, "is the base model's name"),
    ({"lora_name": "x", "lora_path": "ADAPTERS/big"}, 400, "rank 32, above --max-lora-rank 16"),
    ({"lora_name": "a", "lora_path": "ADAPTERS/b"}, 400, "'a' is already loaded"),
    ({"lora_path": "ADAPTERS/b"}, 400, "'lora_name' (a string) is required"),
])
def test_a_bad_load_is_a_400_and_the_others_keep_serving(setup, body, status, message):
    live, adapters = setup
    before = _answer(live, "a")
    body = {k: v.replace("ADAPTERS", str(adapters)) for k, v in body.items()}
    got, _, text = request(live.port, "POST", "/v1/load_lora_adapter", body)
    assert got == status and message in json.loads(text)["error"]["message"], text
    assert set(_models(live)) == {"base", "a"}
    assert _answer(live, "a") == before


def test_runtime_updating_is_opt_in(setup):
    live, adapters = setup
    closed = Live(live.backend, ServerConfig(served_model_names=["base"]))
    try:
        got, _, text = request(closed.port, "POST", "/v1/load_lora_adapter",
                               {"lora_name": "b", "lora_path": str(adapters / "b")})
        assert got == 404 and b"--allow-runtime-lora-updating" in text
        assert set(_models(closed)) == {"base", "a"}
    finally:
        closed.stop()


def test_serve_flags_make_the_lora_config():
    from infc.cli import parser
    from infc.server.args import config_from_args, engine_config
    args = parser().parse_args(["serve", "--model-path", "m", "--enable-lora", "--lora-modules", "a=/x",
                                '{"name": "b", "path": "/y"}', "--max-loras", "3", "--max-lora-rank", "32",
                                "--max-cpu-loras", "5", "--allow-runtime-lora-updating"])
    c = engine_config(args).lora
    assert c.lora_modules == (("a", "/x"), ("b", "/y")) and c.max_cpu_loras == 5
    assert c.build() == {"max_loras": 3, "max_rank": 32, "targets": sorted(c.build()["targets"])}
    assert config_from_args(args).allow_runtime_lora_updating
    clash = parser().parse_args(["serve", "--model-path", "m", "--served-model-name", "a", "--enable-lora",
                                 "--lora-modules", "a=/x"])
    with pytest.raises(ValueError, match=r"adapter name\(s\) \['a'\] are the base model's served name"):
        config_from_args(clash)
    with pytest.raises(ValueError, match="need --enable-lora"):
        engine_config(parser().parse_args(["serve", "--model-path", "m", "--lora-modules", "a=/x"])).lora.build()
