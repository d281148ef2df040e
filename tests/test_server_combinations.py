"""Features that each work alone, served together on the CPU: n-gram speculation, LoRA adapters
loaded and unloaded at run time, structured outputs, the Responses API. What broke in their
combinations, each a client's view: the status and error body, the output obeying what was asked,
and the engine clean and serving afterwards.

- an adapter unloaded while a request for it waits for a slot: the model it named is gone, a 404
  model_not_found naming `model` as for any unknown model (was a 500 "internal error"), streamed
  or not
- /v1/responses with text.format (json_schema, json_object): the output obeys it, as chat's
  response_format (was silently ignored); a bad format and a bad max_output_tokens name the fields
  the client sent (was 'max_completion_tokens')
- bad_words with a logit_bias and n-gram drafts pushing the word: a word whose spaced form is one
  token and its plain form several was let through mid-text (vLLM's same-length rule)
"""
import json
import re
import threading
import time

import pytest

from infc.backend import load_backend
from infc.server.app import ServerConfig

from make_lora_adapter import make_adapter
from test_server_support import Live, assert_clean, one_blas_thread, request, tiny_qwen3_dir  # noqa: F401

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
PROMPT = [785, 6722, 315, 9625, 374, 264, 3283]


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """A tiny Qwen3 (the real Qwen tokenizer) served with speculation, one LoRA slot and adapter
    `a` loaded; the load and unload endpoints open."""
    d = tiny_qwen3_dir(tmp_path_factory.mktemp("qwen3-combinations"), seed=11, max_len=512)
    adapters = tmp_path_factory.mktemp("adapters")
    for i, name in enumerate("ac"):
        make_adapter(d, adapters / name, rank=8, alpha=16, seed=i, std=0.3)
    b = load_backend(d, device="cpu", max_model_len=512, max_num_seqs=8, enable_lora=True, max_loras=1,
                     max_lora_rank=8, lora_modules={"a": str(adapters / "a")}, speculative_config=NGRAM,
                     log=None)
    srv = Live(b, ServerConfig(served_model_names=["base"], allow_runtime_lora_updating=True))
    srv.adapters = adapters
    yield srv
    srv.stop()
    b.engine.shutdown()


def _post(srv, path, body):
    status, _, raw = request(srv.port, "POST", path, body, timeout=120)
    return status, json.loads(raw)


def _waiting_adapters(srv) -> str:
    _, _, raw = request(srv.port, "GET", "/metrics")
    m = re.search(r'waiting_lora_adapters="([^"]*)"', raw.decode())
    return m.group(1) if m else ""


def _streamed(srv, body) -> list:
    """The data events of a streamed completion, [DONE] included."""
    _, _, raw = request(srv.port, "POST", "/v1/completions", dict(body, stream=True), timeout=120)
    return [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]


@pytest.mark.parametrize("stream", [False, True])
def test_an_adapter_unloaded_while_its_request_waits_for_a_slot_is_a_404(live, stream):
    status, _, raw = request(live.port, "POST", "/v1/load_lora_adapter",
                             {"lora_name": "c", "lora_path": str(live.adapters / "c")})
    assert status == 200, raw
    got = {}
    # `a` holds the one slot for a while (no EOS, 400 tokens), so a request for `c` waits
    hold = threading.Thread(target=lambda: got.setdefault("a", _post(live, "/v1/completions", {
        "model": "a", "prompt": PROMPT, "max_tokens": 400, "temperature": 0, "ignore_eos": True})))
    hold.start()
    wait = {"model": "c", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    waiter = threading.Thread(target=lambda: got.setdefault(
        "c", _streamed(live, wait) if stream else _post(live, "/v1/completions", wait)))
    t0 = time.monotonic()
    while not live.engine.loras.holders.get(live.engine.loras.ids["a"]):    # `a` runs
        assert time.monotonic() - t0 < 60 and hold.is_alive()
        time.sleep(0.01)
    waiter.start()
    while _waiting_adapters(live) != "c":
        assert time.monotonic() - t0 < 60 and hold.is_alive(), "`c` never waited for the slot"
        time.sleep(0.01)
    assert request(live.port, "POST", "/v1/unload_lora_adapter", {"lora_name": "c"})[0] == 200
    waiter.join(60)
    hold.join(120)
    if stream:
        events = got["c"]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
    else:
        status, body = got["c"]
        assert status == 404, body
        error = body["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model", error
    assert "The model `c` does not exist" in error["message"] and "unloaded" in error["message"], error
    status, body = got["a"]
    assert status == 200 and body["usage"]["completion_tokens"] == 400, body
    assert _post(live, "/v1/completions", {"model": "a", "prompt": PROMPT, "max_tokens": 3})[0] == 200
    assert_clean(live)
    assert not any(live.engine.loras.holders.values())


def test_an_adapter_named_but_unloaded_before_it_is_queued_is_a_404(live):
    """The engine's own check at add (the server's model check passed, the unload came between)."""
    import asyncio
    from infc.runtime.engine.sampling import SamplingParams
    from infc.server.generation import engine_error

    async def go():
        async for _ in live.backend.engine.generate(PROMPT, SamplingParams(max_tokens=2), "gone-1", lora="gone"):
            pass
    with pytest.raises(ValueError, match="LoRA adapter 'gone' is not loaded") as e:
        asyncio.run(go())
    err = engine_error(e.value)
    assert (err.status, err.code, err.param) == (404, "model_not_found", "model")
    assert_clean(live)


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "enum": [1, 2, 3]}},
          "required": ["ok", "n"], "additionalProperties": False}


@pytest.mark.parametrize("model", ["base", "a"])
def test_responses_text_format_json_schema_is_obeyed(live, model):
    fmt = {"type": "json_schema", "name": "answer", "schema": SCHEMA, "strict": True}
    status, body = _post(live, "/v1/responses", {"model": model, "input": "Answer in JSON.", "temperature": 0,
                                                  "max_output_tokens": 60, "text": {"format": fmt}})
    assert status == 200, body
    assert body["status"] == "completed", body
    value = json.loads(body["output"][0]["content"][0]["text"])
    assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and value["n"] in (1, 2, 3), value
    assert body["text"]["format"] == fmt
    status, body = _post(live, "/v1/responses", {"model": model, "input": "JSON.", "temperature": 0,
                                                  "max_output_tokens": 120,
                                                  "text": {"format": {"type": "json_object"}}})
    assert status == 200, body
    if body["status"] == "completed":
        json.loads(body["output"][0]["content"][0]["text"])
    assert_clean(live)


@pytest.mark.parametrize("extra,param,message", [
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text", "'text.format.schema' is required"),
    ({"text": {"format": {"type": "xml"}}}, "text", "'text.format.type' must be"),
    ({"text": {"format": {"type": "json_schema", "schema": {"type": "nonsense"}}}}, "text", "'text'"),
    ({"text": "json"}, "text", "'text' must be an object"),
    ({"max_output_tokens": 0}, "max_output_tokens", "'max_output_tokens' must be >= 1"),
])
def test_responses_bad_format_or_length_names_the_field_sent(live, extra, param, message):
    status, body = _post(live, "/v1/responses", {"model": "base", "input": "x", **extra})
    assert status == 400 and body["error"]["param"] == param and message in body["error"]["message"], body


@pytest.mark.parametrize("stream", [False, True])
def test_a_bad_word_is_banned_mid_text_where_its_spaced_form_is_one_token(live, stream):
    """bad_words ["exaggerated"]: Qwen's " exaggerated" is one token (61158), "exaggerated" three;
    with a logit_bias pushing " exaggerated" (and n-gram drafts of it) it must still never come
    (vLLM's rule dropped the spaced form: its length differs from the plain one's)."""
    body = {"model": "base", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logit_bias": {"61158": 100},
            "bad_words": ["exaggerated"]}
    if stream:
        events = _streamed(live, body)
        assert events[-1] == "[DONE]"
        text = "".join(c["text"] for e in events[:-1] for c in json.loads(e)["choices"])
    else:
        status, out = _post(live, "/v1/completions", body)
        assert status == 200, out
        text = out["choices"][0]["text"]
    assert "exaggerated" not in text, text
    status, out = _post(live, "/v1/completions", dict(body, bad_words=None))
    assert status == 200 and out["choices"][0]["text"] == " exaggerated" * 8      # what the ban stops
