"""Prompt logprobs over HTTP on SmolLM2 (CPU): lm-eval's `local-completions` requests (echo,
max_tokens 1, logprobs 1, token-id prompts) score the same through the request's own prefill as
through the old forced-token path, and /metrics counts only the client's requests either way;
vLLM's `prompt_logprobs` field on completions and chat; usage.prompt_tokens_details.cached_tokens;
the /metrics names vLLM exports. The real lm-eval class drives the server in the exhaustive case."""
import json
import re
import time
from contextlib import contextmanager

import pytest

from exhaustive import EXHAUSTIVE
from test_server_support import assert_clean, backend, live, one_blas_thread, request, srv  # noqa: F401

TEXT = ("It was a bright cold day in April, and the clocks were striking thirteen. Winston Smith, his "
        "chin nuzzled into his breast in an effort to escape the vile wind, slipped quickly through")


@contextmanager
def forced_tokens(s):
    """The old path: the engine refuses to score prompt rows, the server asks one token at a time."""
    s.engine.scores_prompts = False
    try:
        yield
    finally:
        s.engine.scores_prompts = True


def post(s, body, path="/v1/completions"):
    status, _, raw = request(s.port, "POST", path, body, timeout=600)
    assert status == 200, raw[:400]
    return json.loads(raw)


def scrape(s) -> dict:
    """Every sample of /metrics: 'name{labels}' -> value."""
    status, _, raw = request(s.port, "GET", "/metrics")
    assert status == 200
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in raw.decode().splitlines() if line and not line.startswith("#")}


def delta(after: dict, before: dict, name: str) -> float:
    """after - before of the sample `name` (a name, or a name and its first labels)."""
    key = next(k for k in after if k == name or k.startswith(name if "{" in name else name + "{"))
    return after[key] - before.get(key, 0.0)


def lm_eval_loglikelihood(body: dict, ctxlens: list[int]) -> list[tuple[float, bool]]:
    """What lm-eval's LocalCompletionsAPI.parse_logprobs reads: the continuation's logprobs (the
    echoed prompt after ctxlen, without the generated token) and whether each was the top one."""
    out = []
    for choice, ctxlen in zip(sorted(body["choices"], key=lambda c: c["index"]), ctxlens):
        lps = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        out.append((sum(lps), all(lp == max(top.values()) for lp, top in zip(lps, tops))))
    return out


def test_lm_eval_requests_score_as_forced_tokens_counting_only_the_clients(srv):
    ids = backend().tokenizer.encode(TEXT)
    prompts = [ids[:19], ids[4:15]]                 # lm-eval's context + continuation, as token ids
    body = {"model": "smol", "prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1,
            "seed": 1234, "echo": True}
    runs = {}
    for name in ("forced", "prefill"):
        before = scrape(srv)
        if name == "forced":
            with forced_tokens(srv):
                runs[name] = post(srv, body)
        else:
            runs[name] = post(srv, body)
        after = scrape(srv)
        # the client's two engine requests, whatever the path: not the forced path's 26 internal ones
        assert delta(after, before, 'vllm:request_success_total{finished_reason="length"') == 2
        assert delta(after, before, "vllm:prompt_tokens_total") == 19 + 11
        assert delta(after, before, "vllm:generation_tokens_total") == 2
        assert delta(after, before, "vllm:request_prompt_tokens_count") == 2
        assert delta(after, before, "vllm:request_prompt_tokens_sum") == 19 + 11
        assert delta(after, before, "vllm:iteration_tokens_total_sum") == 19 + 11 + 2
    old, new = runs["forced"], runs["prefill"]
    # the same float32 logprobs, but the forced path's 26 requests batch as the server's timing puts
    # them, so the reductions' order differs: ~2e-6 relative on logprobs of -5 to -11 (a fresh-clone
    # run once saw 1.02e-5 at -4.94); a wrong position or token would move them by nats
    tol = 5e-5
    for a, b in zip(old["choices"], new["choices"]):
        la, lb = a["logprobs"], b["logprobs"]
        assert la["tokens"] == lb["tokens"] and la["text_offset"] == lb["text_offset"]
        assert la["token_logprobs"][0] is None and lb["token_logprobs"][0] is None
        assert lb["token_logprobs"][1:] == pytest.approx(la["token_logprobs"][1:], abs=tol)
        for ta, tb in zip(la["top_logprobs"][1:], lb["top_logprobs"][1:]):
            assert list(ta) == list(tb) and list(ta.values()) == pytest.approx(list(tb.values()), abs=tol)
    ctxlens = [12, 6]
    got, want = lm_eval_loglikelihood(new, ctxlens), lm_eval_loglikelihood(old, ctxlens)
    assert [g for _, g in got] == [g for _, g in want]
    assert [x for x, _ in got] == pytest.approx([x for x, _ in want], abs=1e-4)
    assert_clean(srv)


def test_prompt_logprobs_as_vllm_returns_them(srv):
    ids = backend().tokenizer.encode(TEXT)[:9]
    echo = post(srv, {"model": "smol", "prompt": ids, "max_tokens": 1, "echo": True, "logprobs": 0,
                      "prompt_logprobs": 2, "temperature": 0})
    choice = echo["choices"][0]
    pl = choice["prompt_logprobs"]
    assert len(pl) == len(ids) and pl[0] is None
    for i, entry in enumerate(pl[1:], 1):
        mine = entry[str(ids[i])]
        assert mine["logprob"] == pytest.approx(choice["logprobs"]["token_logprobs"][i], abs=1e-6)
        assert mine["decoded_token"] == choice["logprobs"]["tokens"][i]
        ranked = sorted(v["rank"] for k, v in entry.items() if k != str(ids[i]) or v["rank"] <= 2)
        assert ranked[:2] == [1, 2] and set(entry) >= {str(ids[i])} and len(entry) in (2, 3)
        assert (mine["rank"] <= 2) == (len(entry) == 2)       # the token itself, and the top 2
    assert choice["logprobs"]["top_logprobs"][1] == {choice["logprobs"]["tokens"][1]:
                                                      choice["logprobs"]["token_logprobs"][1]}   # logprobs 0
    # streamed, the echo's chunk waits for the prompt's logprobs (they come with its first token)
    status, _, raw = request(srv.port, "POST", "/v1/completions", {
        "model": "smol", "prompt": ids, "max_tokens": 2, "echo": True, "logprobs": 0, "temperature": 0,
        "stream": True})
    events = [json.loads(line[6:]) for line in raw.decode().splitlines()
              if line.startswith("data: {")]
    assert status == 200 and all("error" not in e for e in events), raw[:300]
    first = events[0]["choices"][0]["logprobs"]
    assert first["token_logprobs"] == pytest.approx(choice["logprobs"]["token_logprobs"][:len(ids)], abs=1e-6)
    chat = post(srv, {"model": "smol", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
                      "prompt_logprobs": 1}, "/v1/chat/completions")
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert "prompt_logprobs" not in chat["choices"][0] or chat["choices"][0].get("prompt_logprobs") is None
    status, _, raw = request(srv.port, "POST", "/v1/completions", {"model": "smol", "prompt": "Hi",
                                                                   "stream": True, "prompt_logprobs": 1})
    assert status == 400 and json.loads(raw)["error"]["message"] == \
        "`prompt_logprobs` are not available when `stream=True`."
    plain = post(srv, {"model": "smol", "prompt": "Hi", "max_tokens": 1})
    assert plain["choices"][0]["prompt_logprobs"] is None and "prompt_tokens_details" not in plain["usage"]
    assert_clean(srv)


def test_cached_tokens_with_prompt_tokens_details(srv):
    """--enable-prompt-tokens-details: the prompt tokens the prefix cache held; a request scoring
    its prompt takes no hit (its cached rows would have no logits)."""
    s = live(enable_prompt_tokens_details=True)
    ids = backend().tokenizer.encode(TEXT + " the glass doors of Victory Mansions")[:40]
    body = {"model": "smol", "prompt": ids, "max_tokens": 1, "temperature": 0}
    first = post(s, body)
    second = post(s, body)
    scored = post(s, dict(body, prompt_logprobs=0))
    page = backend().page_size
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": (len(ids) - 1) // page * page}
    assert scored["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert first["usage"]["prompt_tokens"] == 40
    assert_clean(s)


def test_metrics_has_vllms_names_with_their_values(srv):
    before = scrape(srv)
    t0 = time.monotonic()
    post(srv, {"model": "smol", "prompt": TEXT, "max_tokens": 3, "ignore_eos": True, "temperature": 0})
    wall = time.monotonic() - t0
    after = scrape(srv)
    n = len(backend().tokenizer.encode(TEXT))
    assert delta(after, before, "vllm:request_generation_tokens_sum") == 3
    assert delta(after, before, "vllm:request_prompt_tokens_sum") == n
    for name in ("request_time_per_output_token_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_inference_time_seconds"):
        assert delta(after, before, f"vllm:{name}_count") == 1
        assert 0 < delta(after, before, f"vllm:{name}_sum") < wall
    decode = delta(after, before, "vllm:request_decode_time_seconds_sum")
    assert delta(after, before, "vllm:request_time_per_output_token_seconds_sum") == pytest.approx(decode / 2)
    assert delta(after, before, "vllm:request_inference_time_seconds_sum") == pytest.approx(
        decode + delta(after, before, "vllm:request_prefill_time_seconds_sum"))
    assert delta(after, before, "vllm:iteration_tokens_total_count") == 3      # prefill, 2 decodes
    assert delta(after, before, "vllm:iteration_tokens_total_sum") == n + 3
    # the token-count buckets are vLLM's 1-2-5 series up to the context length
    les = [float(m) for m in re.findall(r'vllm:request_prompt_tokens_bucket\{le="([0-9.]+)"', "\n".join(after))]
    assert les[:4] == [1, 2, 5, 10] and les[-1] <= backend().max_model_len < les[-1] * 2.5
    info = next(k for k in after if k.startswith("vllm:cache_config_info{"))
    assert f'block_size="{backend().page_size}"' in info and f'num_gpu_blocks="{srv.engine.bm.num_pages}"' in info
    assert after["process_resident_memory_bytes"] > 1 << 20
    assert any(k.startswith("python_gc_objects_collected_total") for k in after)
    assert_clean(srv)


@EXHAUSTIVE
def test_lm_eval_local_completions_5x_faster_same_numbers(srv):
    """lm-eval's own LocalCompletionsAPI (its payloads and parsing) against the server: the
    loglikelihood and loglikelihood_rolling numbers of the forced-token path, >= 5x faster."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    lm = LocalCompletionsAPI(base_url=srv.url + "/v1/completions", model="smol",
                             tokenizer=str(backend().model_dir), tokenizer_backend="huggingface",
                             max_length=backend().max_model_len, batch_size=8, num_concurrent=1,
                             max_retries=1)
    ctx = [TEXT[:100 + 10 * i] for i in range(8)]
    cont = [" and then", " the hallway", " smelt of", " boiled cabbage", " and old", " rag mats",
            " At one end", " of it"]
    lls = [Instance("loglikelihood", {}, (c, x), i) for i, (c, x) in enumerate(zip(ctx, cont))]
    rolling = [Instance("loglikelihood_rolling", {}, (TEXT * 2,), 0)]
    runs = {}
    for name in ("forced", "prefill"):
        t0 = time.perf_counter()
        if name == "forced":
            with forced_tokens(srv):
                got = lm.loglikelihood(lls, disable_tqdm=True), lm.loglikelihood_rolling(rolling, disable_tqdm=True)
        else:
            got = lm.loglikelihood(lls, disable_tqdm=True), lm.loglikelihood_rolling(rolling, disable_tqdm=True)
        runs[name] = got, time.perf_counter() - t0
    (old, t_old), (new, t_new) = runs["forced"], runs["prefill"]
    assert [g for _, g in new[0]] == [g for _, g in old[0]]
    assert [x for x, _ in new[0]] == pytest.approx([x for x, _ in old[0]], abs=1e-4)
    assert new[1] == pytest.approx(old[1], abs=1e-3)
    assert t_old >= 5 * t_new, (t_old, t_new)
    assert_clean(srv)


def test_embeddings_refused_and_responses_served_as_vllm_does(srv):
    """A generative model: /v1/embeddings is vLLM's 400; /v1/responses runs over the chat path
    (the same tokens as the chat completion of the same messages)."""
    status, _, raw = request(srv.port, "POST", "/v1/embeddings", {"model": "smol", "input": "hello"})
    assert status == 400 and json.loads(raw) == {"error": {
        "message": "The model does not support Embeddings API", "type": "BadRequestError", "param": None,
        "code": 400}}
    resp = post(srv, {"model": "smol", "instructions": "Answer briefly.", "max_output_tokens": 3,
                      "temperature": 0, "input": [{"role": "user", "content": [
                          {"type": "input_text", "text": "What is the capital of France?"}]}]}, "/v1/responses")
    chat = post(srv, {"model": "smol", "max_tokens": 3, "temperature": 0, "messages": [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is the capital of France?"}]}, "/v1/chat/completions")
    assert resp["object"] == "response" and resp["id"].startswith("resp_")
    (msg,) = resp["output"]
    assert msg["type"] == "message" and msg["role"] == "assistant"
    assert msg["content"][0]["type"] == "output_text"
    assert msg["content"][0]["text"] == chat["choices"][0]["message"]["content"]
    finished = chat["choices"][0]["finish_reason"] == "stop"
    assert resp["status"] == ("completed" if finished else "incomplete")
    assert resp["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]
    assert resp["usage"]["output_tokens"] == chat["usage"]["completion_tokens"]
    simple = post(srv, {"model": "smol", "input": "Hi", "max_output_tokens": 1}, "/v1/responses")
    assert simple["usage"]["output_tokens"] == 1 and simple["incomplete_details"] == {"reason": "max_output_tokens"}
    for refused in ({"stream": True}, {"tools": [{"type": "function", "name": "f"}]},
                    {"previous_response_id": "resp_x"}):
        status, _, raw = request(srv.port, "POST", "/v1/responses", {"model": "smol", "input": "Hi", **refused})
        assert status == 400 and "not supported" in json.loads(raw)["error"]["message"], raw
    status, _, raw = request(srv.port, "POST", "/v1/responses", {"model": "smol", "input": [{"type": "input_image"}]})
    assert status == 400 and json.loads(raw)["error"]["param"] == "input"
    assert_clean(srv)
