"""More malformed LoRA input, beyond tests/test_lora_slots.py's MALFORMED: each is refused naming
what and where, changes nothing and kills nothing. Adapter directories (JSON nested too deep, an
alpha no float holds, bad regexes, integer or fp8 weights, a path that is a file or too long),
adapters that go bad after they were registered (unloaded while a request waits for a slot, the
directory removed once the host cache dropped them: that request fails, the engine goes on),
the load endpoint (a 400, never a 500) and --lora-modules / --max-cpu-loras (refused before the
model loads)."""
import json
import shutil

import numpy as np
import pytest

from infc.runtime.engine.sampling import SamplingParams
from infc.runtime.lora.tables import AdapterError

from make_lora_adapter import make_adapter
from safetensors_write import write_raw
from test_lora_engine import PROMPTS, _engine
from test_lora_engine import model  # noqa: F401 - a fixture
from test_lora_slots import Q, _corrupt, _slots, _tables
from test_lora_slots import served  # noqa: F401 - a fixture
from test_server_lora import _answer, _complete, _models
from test_server_lora import setup  # noqa: F401 - a fixture
from test_server_support import one_blas_thread, request  # noqa: F401 - an autouse fixture

W = "adapter_model.safetensors"
DEEP = "[" * 100_000 + "]" * 100_000            # parses only with a recursion depth of 100,000


def _set(**kw):
    return lambda b, c: c.update(kw)


def _dtype(dt: str, array):
    """Q's lora_A written as `dt` (safetensors dtype) holding `array`'s bytes."""
    def how(b, c):
        from safetensors.numpy import load_file
        t = {k: ("F32", v) for k, v in load_file(b / W).items()}
        t[Q + ".lora_A.weight"] = (dt, array)
        write_raw(b / W, t)
    return how


def _deep_header(b, c):
    h = DEEP.encode()
    (b / W).write_bytes(len(h).to_bytes(8, "little") + h)


# case -> (how to break adapter a, the error's words): `how` edits adapter_config.json's dict
# (written back after) or the directory (test_lora_slots._corrupt)
MORE = {
    "config nested too deep": (lambda b, c: None, r"adapter_config.json is not JSON"),     # written below
    "alpha too large for a float": (_set(lora_alpha=10 ** 400), r"'lora_alpha' must be a positive number"),
    "alpha past float32": (_set(lora_alpha=1e300), r"non-finite scale or weight \(scale 1.25e\+299\)"),
    "rank_pattern key not a regex": (_set(rank_pattern={"(": 8}),
                                     r"'rank_pattern' key '\(' is not a valid regex"),
    "alpha_pattern key a regex only alone": (_set(alpha_pattern={"(?i)q_proj": 4}),
                                             r"'alpha_pattern' key '\(\?i\)q_proj' is not a valid regex"),
    "target_modules not a regex": (_set(target_modules="[q_proj"), r"'target_modules' '\[q_proj' is not a valid regex"),
    "rank_pattern float": (_set(rank_pattern={"q_proj": 8.0}),
                           r"'rank_pattern' must map module names to positive integers"),
    "use_rslora a string": (_set(use_rslora="false"), r"'use_rslora' must be true or false, got 'false'"),
    "int8 weights": (_dtype("I8", np.ones((8, 64), np.int8)), r"lora_A.weight' is I8; LoRA weights are floating point"),
    "bool weights": (_dtype("BOOL", np.ones((8, 64), np.bool_)), r"is BOOL; LoRA weights are floating point"),
    "fp8 e5m2 weights": (_dtype("F8_E5M2", np.ones((8, 64), np.uint8)),
                         r"is F8_E5M2; LoRA weights are floating point"),
    "safetensors header nested too deep": (_deep_header, r"adapter_model.safetensors is not a readable safetensors file"),
}


@pytest.mark.parametrize("case", sorted(MORE))
def test_more_malformed_adapters_are_refused_naming_what_and_nothing_changes(case, served, tmp_path):  # noqa: F811
    d, plan, root = served
    slots, weights = _slots(served)
    slots.register("good", root / "b")
    assert slots.acquire("good") == 1
    before = _tables(plan, weights)
    how, message = MORE[case]
    bad = _corrupt(root, tmp_path, how)
    if case == "config nested too deep":
        (bad / "adapter_config.json").write_text(DEEP)
    with pytest.raises(AdapterError, match=message) as e:
        slots.register("bad", bad)
    assert f"LoRA adapter 'bad' ({bad})" in str(e.value)              # what and where
    assert slots.names() == ["good"] and "bad" not in slots.host
    for x, y in zip(before, _tables(plan, weights)):
        np.testing.assert_array_equal(x, y)
    assert slots.acquire("good") == 1


def test_a_path_that_is_a_file_or_too_long_is_named_so(served, tmp_path):  # noqa: F811
    d, plan, root = served
    slots, _ = _slots(served)
    with pytest.raises(AdapterError, match=r"a file, not an adapter directory"):
        slots.register("x", root / "a" / W)
    with pytest.raises(AdapterError, match=r"'x' \(/tmp/a{300}\): cannot read it \(File name too long\)"):
        slots.register("x", "/tmp/" + "a" * 300)
    assert slots.names() == []


GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def _outputs(engine) -> dict:
    """request id -> its last StepOutput, stepping until every request ended."""
    last = {}
    for _ in range(200):
        if not engine.has_unfinished():
            return last
        for o in engine.step():
            last[o.request_id] = o
    raise AssertionError("the engine did not finish its requests")


def test_unloading_an_adapter_a_request_waits_for_ends_that_request_not_the_engine(model):  # noqa: F811
    d, root = model
    engine = _engine(d, root, 2, names="abc")
    for rid, lora in (("ra", "a"), ("rb", "b"), ("rc", "c"), ("rbase", None)):
        engine.add_request(PROMPTS[0], GREEDY, rid, lora=lora)
    engine.step()                                   # a and b take both slots; c waits
    assert [s.request_id for s in engine.scheduler.waiting] == ["rc", "rbase"]
    engine.loras.unregister("c")
    out = _outputs(engine)
    assert out["rc"].finish_reason == "error"
    assert "LoRA adapter 'c' was unloaded while this request waited for a slot" in str(out["rc"].error)
    assert {out[r].finish_reason for r in ("ra", "rb", "rbase")} == {"length"}
    assert not any(engine.loras.holders.values()) and not engine.loras.failed
    assert engine.bm.num_free_pages == engine.bm.num_pages
    engine.add_request(PROMPTS[1], GREEDY, "again", lora="a")      # it goes on serving
    assert _outputs(engine)["again"].finish_reason == "length"


def test_an_adapter_whose_directory_went_away_fails_its_request_not_the_engine(model, tmp_path):  # noqa: F811
    d, root = model
    for n in "abc":
        shutil.copytree(root / n, tmp_path / n)
    # 2 adapters kept read: registering c drops a, which is read again from its path when needed
    engine = _engine(d, tmp_path, 2, names="abc", max_cpu_loras=2)
    assert engine.loras.ids["a"] not in engine.loras.host
    shutil.rmtree(tmp_path / "a")
    engine.add_request(PROMPTS[0], GREEDY, "ra", lora="a")
    engine.add_request(PROMPTS[1], GREEDY, "rb", lora="b")
    out = _outputs(engine)
    assert out["ra"].finish_reason == "error"
    assert f"LoRA adapter 'a' ({tmp_path / 'a'}): no such directory" in str(out["ra"].error)
    assert out["rb"].finish_reason == "length"
    assert engine.bm.num_free_pages == engine.bm.num_pages and not any(engine.loras.holders.values())


def _load(live, body):
    status, _, text = request(live.port, "POST", "/v1/load_lora_adapter", body)
    return status, json.loads(text) if status != 200 else text


@pytest.mark.parametrize("case", ["path too long", "path a file", "rank_pattern key not a regex"])
def test_a_bad_load_over_the_api_is_a_400_never_a_500(setup, case, tmp_path):  # noqa: F811
    live, adapters = setup
    before = _answer(live, "a")
    if case == "path too long":
        path, words = "/tmp/" + "a" * 300, "cannot read it (File name too long)"
    elif case == "path a file":
        path, words = str(adapters / "a" / W), "a file, not an adapter directory"
    else:
        path, words = str(tmp_path / "bad"), "'rank_pattern' key '(' is not a valid regex"
        shutil.copytree(adapters / "a", path)
        cfg = json.loads((tmp_path / "bad" / "adapter_config.json").read_text())
        cfg["rank_pattern"] = {"(": 8}
        (tmp_path / "bad" / "adapter_config.json").write_text(json.dumps(cfg))
    status, body = _load(live, {"lora_name": "x", "lora_path": path})
    assert status == 400 and words in body["error"]["message"], body
    assert body["error"]["param"] == "lora_path" and body["error"]["type"] == "invalid_request_error"
    assert set(_models(live)) == {"base", "a"}
    assert _answer(live, "a") == before


def test_an_adapter_gone_from_disk_fails_its_requests_and_the_server_keeps_serving(setup, tmp_path):  # noqa: F811
    live, adapters = setup
    before = _answer(live, "a")
    for n in ("gone", "x1", "x2"):
        shutil.copytree(adapters / "b", tmp_path / n)
        assert _load(live, {"lora_name": n, "lora_path": str(tmp_path / n)})[0] == 200
    try:
        # the host cache holds --max-loras (2) adapters: x1 and x2; gone is read again when asked
        shutil.rmtree(tmp_path / "gone")
        status, body = _complete(live, "gone")
        assert status == 500 and f"LoRA adapter 'gone' ({tmp_path / 'gone'}): no such directory" \
            in body["error"]["message"], body
        assert request(live.port, "GET", "/health")[0] == 200
        assert _answer(live, "a") == before
    finally:
        for n in ("gone", "x1", "x2"):
            request(live.port, "POST", "/v1/unload_lora_adapter", {"lora_name": n})
    assert set(_models(live)) == {"base", "a"}


def _lora_config(*flags):
    from infc.cli import parser
    from infc.server.args import engine_config
    return engine_config(parser().parse_args(["serve", "--model-path", "m", "--enable-lora", *flags])).lora


@pytest.mark.parametrize("flags,message", [
    (["--lora-modules", "a=/x", "a=/y"], "adapter name 'a' is given twice"),
    (["--lora-modules", "a=/x", '{"name": "a", "path": "/y"}'], "adapter name 'a' is given twice"),
    (["--max-cpu-loras", "0"], r"--max-cpu-loras \(0\) must be at least --max-loras \(1\)"),
])
def test_lora_flags_that_cannot_serve_are_refused_before_the_model_loads(flags, message):
    with pytest.raises(ValueError, match=message):
        _lora_config(*flags).build()


@pytest.mark.parametrize("item", ['{"name": 5, "path": null}', '{"name": "", "path": "/x"}',
                                  '{"name": "a", "path": ["/x"]}'])
def test_a_json_lora_module_needs_string_name_and_path(item, capsys):
    with pytest.raises(SystemExit):
        _lora_config("--lora-modules", item)
    assert "'name' and 'path' must be non-empty strings" in capsys.readouterr().err


def test_the_fixture_adapters_still_load(served, tmp_path):  # noqa: F811
    """The checks refuse nothing a PEFT-shaped adapter holds: bf16 weights, rsLoRA, integer and
    float alphas, pattern keys."""
    d, plan, root = served
    slots, _ = _slots(served)
    make_adapter(d, tmp_path / "ok", rank=8, alpha=12.5, rslora=True, rank_pattern={"o_proj": 16},
                 alpha_pattern={r"mlp\.up_proj": 3}, dtype="bf16")
    slots.register("ok", tmp_path / "ok")
    assert slots.host[slots.ids["ok"]].modules["model.layers.0.mlp.up_proj"].scale == pytest.approx(3 / 8 ** 0.5)
