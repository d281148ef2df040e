"""The OpenAI-compatible server end to end, driven by the real `openai` SDK (in CI on the CPU backend,
once per model: the real SmolLM2-135M, a tiny random Qwen3.5 (hybrid: state slots and their snapshots)
and a tiny random DeepSeek-V2 (latent KV cache), the two with the real Qwen tokenizer; on any model
and device through test_server_support's variables): completions and chat, streaming with and
without usage, n > 1, logprobs, echo with prompt logprobs, stop strings and ids, seeds, the error
cases (400 / 404 / 401 / 413 / 429 and the context length), /tokenize, /detokenize,
/tokenizer_info, /metrics, /health through loading and engine death, valid UTF-8 on the wire,
TCP_NODELAY, and a long prompt replayed (over cached prefix pages where the engine keeps them).
Generations are a few tokens each: a numpy decode step of SmolLM2 takes tens to hundreds of ms on
CI (the tiny models' suites take ~10 s each)."""
import json
import socket

import openai
import pytest

from infc.runtime.engine.async_engine import AsyncEngine, EngineDeadError
from infc.runtime.engine.engine import Engine
from infc.runtime.engine.runner import Sample
from infc.server.app import ServerConfig, ServerState, make_app
from infc.backend import Backend
from infc.server.serve import ServerThread
from test_server_support import (run_together, DEFAULT, DEVICE, MAX_MODEL_LEN, MODELS, NAMES, assert_clean, backend, current,  # noqa: F401
                                 live, one_blas_thread, per_model_srv, request)

PROMPT = "The capital of France is"
GREEDY = dict(temperature=0)


# every test taking the server runs once per model of test_server_support.MODELS (SmolLM2, and the
# tiny random Qwen3.5 and DeepSeek-V2 on the CPU; `-k qwen3_5` selects one). The fast suite runs
# all of them on the default model and, on the others, those marked backend_specific: what an
# engine with state slots (prefix hits through state snapshots) or a latent KV cache, or the Qwen tokenizer, could get
# wrong. The HTTP layer's own cases (errors, auth, caps, metrics) run on them with --exhaustive.
srv = per_model_srv(MODELS, fast=[DEFAULT])
backend_specific = pytest.mark.backend_specific


def n_prompt() -> int:
    return len(backend().tokenizer.encode(PROMPT))


def single_token(text: str) -> int | None:
    """The id of the one token whose text this is, or None (a generated token's string from
    logprobs, turned back into its id)."""
    tok = backend().tokenizer
    ids = tok.encode(text)
    return ids[0] if len(ids) == 1 and tok.decode(ids, skip_special_tokens=False) == text else None


def first_stop(tokens: list[str], start: int = 0):
    """(k, text, id) of the first generated token usable as a stop string and a stop id: it is
    printable, one token, and the text's first occurrence is where it was generated."""
    text = "".join(tokens)
    for k in range(start, len(tokens)):
        t = tokens[k]
        if t.strip() and "\ufffd" not in t and single_token(t) is not None \
                and text.index(t) == len("".join(tokens[:k])):
            return k, t, single_token(t)
    raise AssertionError(f"no generated token to stop on in {tokens!r}")


def parallel(*fns):
    """Run SDK calls at once (they share engine steps); return their results in order. One at a
    time when current().serial (a random-weight model: see test_server_support)."""
    if current().serial:
        return [f() for f in fns]
    return run_together(fns, 300)


# -- completions ----------------------------------------------------------------------------------
@backend_specific
def test_completion_prompt_forms_agree(srv):
    c = srv.client()
    ids = backend().tokenizer.encode(PROMPT)
    one, as_ids, batch = parallel(
        lambda: c.completions.create(model="smol", prompt=PROMPT, max_tokens=3, **GREEDY),
        lambda: c.completions.create(model="smol-alias", prompt=ids, max_tokens=3, **GREEDY),
        lambda: c.completions.create(model="smol", prompt=[ids, backend().tokenizer.encode("Hello")], max_tokens=3, **GREEDY))
    assert one.object == "text_completion" and one.model == "smol" and as_ids.model == "smol-alias"
    if current().real:
        assert one.choices[0].text.startswith(" Paris")
    assert as_ids.choices[0].text == one.choices[0].text == batch.choices[0].text
    assert [ch.index for ch in batch.choices] == [0, 1]
    assert one.usage.prompt_tokens == len(ids) == n_prompt() and one.usage.completion_tokens == 3
    assert one.usage.total_tokens == len(ids) + 3
    assert batch.usage.prompt_tokens == len(ids) + len(backend().tokenizer.encode("Hello"))
    assert one.choices[0].finish_reason == "length"


@backend_specific
def test_streaming_with_and_without_usage(srv):
    c = srv.client()
    full = c.completions.create(model="smol", prompt=PROMPT, max_tokens=4, **GREEDY)

    def stream(usage):
        kw = {"stream_options": {"include_usage": True}} if usage else {}
        return list(c.completions.create(model="smol", prompt=PROMPT, max_tokens=4, stream=True, **kw, **GREEDY))

    plain, counted = parallel(lambda: stream(False), lambda: stream(True))
    for chunks in (plain, counted):
        text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        assert text == full.choices[0].text
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert all(ch.usage is None for ch in plain)
    assert all(ch.usage is None for ch in counted[:-1])
    last = counted[-1]
    assert last.choices == [] and last.usage.completion_tokens == 4
    assert last.usage.prompt_tokens == n_prompt() and last.usage.total_tokens == n_prompt() + 4


def test_chat_and_chat_streaming(srv):
    c = srv.client()
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    full, chunks = parallel(
        lambda: c.chat.completions.create(model="smol", messages=msgs, max_tokens=4, **GREEDY),
        lambda: list(c.chat.completions.create(model="smol", messages=msgs, max_completion_tokens=4, stream=True,
                                               stream_options={"include_usage": True}, **GREEDY)))
    assert full.object == "chat.completion" and full.choices[0].message.role == "assistant"
    assert full.choices[0].message.content and full.choices[0].finish_reason == "length"
    n_prompt = request(srv.port, "POST", "/tokenize", {"messages": msgs})
    assert full.usage.prompt_tokens == json.loads(n_prompt[2])["count"]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 4 and chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


@backend_specific
def test_n_and_seed_reproducibility(srv):
    """The same seed gives the same tokens. Each pair runs one after the other: on a GPU, rows
    batched with other requests take other kernel paths (bf16 rounding differs), and on a nearly
    flat random-weight distribution any rounding difference moves a draw."""
    c = srv.client()
    # top_k: draws that tiny rounding cannot move (a flat 151k-token distribution's are not)
    kw = dict(model="smol", prompt="Once upon a time", max_tokens=4, temperature=1.0,
              extra_body={"ignore_eos": True, "top_k": 8})
    a = c.completions.create(seed=1234, **kw)
    b = c.completions.create(seed=1234, **kw)
    other = c.completions.create(seed=99, **kw)
    many = c.completions.create(seed=7, n=3, **kw)
    streamed = list(c.completions.create(seed=7, n=3, stream=True, stream_options={"include_usage": True}, **kw))
    assert a.choices[0].text == b.choices[0].text
    assert other.choices[0].text != a.choices[0].text
    assert [ch.index for ch in many.choices] == [0, 1, 2]
    assert many.usage.completion_tokens == 12 and many.usage.prompt_tokens == a.usage.prompt_tokens
    assert len({ch.text for ch in many.choices}) > 1
    # n > 1 streamed (same seed): every index arrives, usage counts every sequence's tokens
    texts = {}
    for ch in streamed[:-1]:
        for x in ch.choices:
            texts[x.index] = texts.get(x.index, "") + x.text
    assert texts == {i: many.choices[i].text for i in range(3)}
    assert streamed[-1].usage.completion_tokens == 12
    if not current().serial:         # n > 1 greedy: each sequence (its own pages, its own state slot) as one alone
        one, three = [c.completions.create(model="smol", prompt="Once upon a time", max_tokens=4, n=k, **GREEDY,
                                           extra_body={"ignore_eos": True}) for k in (1, 3)]
        assert [ch.text for ch in three.choices] == [one.choices[0].text] * 3


@backend_specific
def test_logprobs_completion_and_chat(srv):
    c = srv.client()
    comp, chat = parallel(
        lambda: c.completions.create(model="smol", prompt=PROMPT, max_tokens=3, logprobs=3, **GREEDY),
        lambda: c.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                          logprobs=True, top_logprobs=2, **GREEDY))
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    if not any("\ufffd" in t for t in lp.tokens):     # a token may hold part of a character
        assert "".join(lp.tokens) == comp.choices[0].text
        assert lp.text_offset == [0, len(lp.tokens[0]), len(lp.tokens[0]) + len(lp.tokens[1])]
    for tok, l, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert l <= 0 and len(top) >= 3 and abs(max(top.values()) - l) < 1e-6   # greedy: the best one
    content = chat.choices[0].logprobs.content
    assert len(content) == 3
    for e in content:
        assert len(e.top_logprobs) == 2 and e.logprob <= 0 and bytes(e.bytes).decode() == e.token
        assert abs(e.top_logprobs[0].logprob - e.logprob) < 1e-6


@backend_specific
def test_echo_with_prompt_logprobs(srv):
    c = srv.client()
    gen = c.completions.create(model="smol", prompt=PROMPT, max_tokens=1, logprobs=2, **GREEDY)
    paris = gen.choices[0].logprobs
    echoed, zero, streamed = parallel(
        lambda: c.completions.create(model="smol", prompt=PROMPT + paris.tokens[0], max_tokens=2, echo=True,
                                     logprobs=2, **GREEDY),
        lambda: c.completions.create(model="smol", prompt=PROMPT, max_tokens=0, echo=True, logprobs=1),
        lambda: list(c.completions.create(model="smol", prompt=PROMPT, max_tokens=2, echo=True, stream=True, **GREEDY)))
    e = echoed.choices[0]
    assert e.text.startswith(PROMPT + paris.tokens[0])
    lp = e.logprobs
    tok, n = backend().tokenizer, n_prompt()
    n_echo = len(tok.encode(PROMPT + paris.tokens[0]))
    assert len(lp.tokens) == n_echo + 2 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    # the prompt's last token (" Paris") is scored exactly as generation scored it, when the text
    # re-tokenizes to the prompt's ids + the generated one (always for SmolLM2 here)
    if current().real or tok.encode(PROMPT + paris.tokens[0])[:n] == tok.encode(PROMPT) and n_echo == n + 1:
        assert n_echo == n + 1 and lp.tokens[n] == paris.tokens[0]
        tol = 1e-4 if DEVICE == "cpu" else 0.05          # bf16 on a GPU: other kernels score it
        assert abs(lp.token_logprobs[n] - paris.token_logprobs[0]) < tol
    assert all(x <= 0 for x in lp.token_logprobs[1:]) and all(len(t) >= 2 for t in lp.top_logprobs[1:])
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    assert echoed.usage.prompt_tokens == n_echo and echoed.usage.completion_tokens == 2
    z = zero.choices[0]
    assert z.text == PROMPT and z.logprobs.token_logprobs[0] is None and len(z.logprobs.tokens) == n
    assert zero.usage.completion_tokens == 0
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices).startswith(PROMPT + paris.tokens[0])
    if current().real:
        assert paris.tokens[0] == " Paris"
    assert_clean(srv)


def pages_long_prompt(pages: int) -> str:
    """A sentence repeated until the prompt holds more than `pages` full KV pages of the backend
    (its page size: 16 on the CPU, the GPU tuning table's on a GPU, 64 on an H200)."""
    sentence, tok, page = "The quick brown fox jumps over the lazy dog. ", backend().tokenizer, backend().page_size
    prompt = sentence
    while len(tok.encode(prompt)) <= pages * page:
        prompt += sentence
    assert len(tok.encode(prompt)) + 4 <= MAX_MODEL_LEN, f"{pages} pages of {page} tokens do not fit {MAX_MODEL_LEN}"
    return prompt


@backend_specific
def test_long_prompt_replayed(srv):
    """A prompt of several full pages sent again, then echoed: the same greedy tokens and, within
    rounding, the same logprobs, whether the engine serves it again from cached prefix pages
    (SmolLM2's KV, DeepSeek-V2's latent c_kv | k_pe pages, Qwen3.5's pages with the state
    snapshot taken at the prompt's last block boundary) or recomputes it."""
    c, e = srv.client(), srv.engine
    prompt = pages_long_prompt(2)
    hits = e.bm.hit_tokens
    first, again, echoed = [c.completions.create(model="smol", prompt=prompt, max_tokens=4, logprobs=1, echo=echo,
                                                 **GREEDY) for echo in (False, False, True)]
    tol = 1e-4 if DEVICE == "cpu" else 0.05
    n = len(backend().tokenizer.encode(prompt))
    assert n > 2 * backend().page_size
    assert again.choices[0].text == first.choices[0].text and echoed.choices[0].text.startswith(prompt)
    want, runs = first.choices[0].logprobs.token_logprobs, [again]
    if not current().serial:         # (on a GPU, prompt logprobs' prefill is another kernel path)
        assert echoed.choices[0].text == prompt + first.choices[0].text
        runs.append(echoed)
    for run in runs:
        got = run.choices[0].logprobs.token_logprobs[-4:]
        assert max(abs(a - b) for a, b in zip(got, want)) < tol, (got, want)
    if e.bm.enable_prefix_caching:
        assert e.bm.hit_tokens - hits >= backend().page_size       # the replay reused full pages
    assert_clean(srv)


@backend_specific
def test_stop_strings_and_ids(srv):
    c = srv.client()
    base = c.completions.create(model="smol", prompt=PROMPT, max_tokens=6, logprobs=1, **GREEDY).choices[0]
    k, stop, stop_id = first_stop(base.logprobs.tokens, start=1)
    if current().real:
        assert (k, stop) == (1, ".")                                 # " Paris.\n\n..."
    other = "zz" if "zz" not in base.text else "\x01zz"
    stopped, streamed, by_id = parallel(
        lambda: c.completions.create(model="smol", prompt=PROMPT, max_tokens=6, stop=[stop], **GREEDY),
        lambda: list(c.completions.create(model="smol", prompt=PROMPT, max_tokens=6, stop=[stop, other], stream=True,
                                          **GREEDY)),
        lambda: c.completions.create(model="smol", prompt=PROMPT, max_tokens=6, **GREEDY,
                                     extra_body={"stop_token_ids": [stop_id]}))
    s = stopped.choices[0]
    assert s.text == base.text[: base.text.index(stop)] and s.finish_reason == "stop"
    assert s.model_extra.get("stop_reason") == stop
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == s.text
    assert [ch.choices[0].finish_reason for ch in streamed if ch.choices][-1] == "stop"
    assert by_id.choices[0].finish_reason == "stop" and by_id.choices[0].text == s.text
    assert by_id.choices[0].model_extra.get("stop_reason") == stop_id


def test_sampling_fields_reach_the_engine(srv):
    """Each field changes what runs: top_k=1 and min_p=1 are greedy whatever the temperature;
    min_tokens holds a stop token back (it is banned until then)."""
    c = srv.client()
    first = c.completions.create(model="smol", prompt=PROMPT, max_tokens=6, logprobs=1, **GREEDY).choices[0]
    k, _, dot = first_stop(first.logprobs.tokens, start=1)
    greedy, topk1, minp, stop_at_dot, held = parallel(
        lambda: c.completions.create(model="smol", prompt=PROMPT, max_tokens=6, **GREEDY),
        lambda: c.completions.create(model="smol", prompt=PROMPT, max_tokens=6, temperature=1.5, seed=3,
                                     extra_body={"top_k": 1}),
        lambda: c.completions.create(model="smol", prompt=PROMPT, max_tokens=6, temperature=1.5, seed=3,
                                     top_p=0.5, extra_body={"min_p": 1.0}),
        lambda: c.completions.create(model="smol", prompt=PROMPT, max_tokens=6, **GREEDY,
                                     extra_body={"stop_token_ids": [dot]}),
        lambda: c.completions.create(model="smol", prompt=PROMPT, max_tokens=6, **GREEDY,
                                     logprobs=1, extra_body={"stop_token_ids": [dot], "min_tokens": 6}))
    assert topk1.choices[0].text == greedy.choices[0].text == minp.choices[0].text == first.text
    if current().real:
        assert greedy.choices[0].text.startswith(" Paris.") and k == 1
    assert stop_at_dot.choices[0].finish_reason == "stop" and stop_at_dot.usage.completion_tokens == k + 1
    assert held.choices[0].finish_reason == "length" and held.usage.completion_tokens == 6
    assert first.logprobs.tokens[k] not in held.choices[0].logprobs.tokens


# -- errors ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw,param", [
    (dict(temperature=-1), "temperature"), (dict(top_p=1.5), "top_p"), (dict(n=0), "n"), (dict(n=10_000), "n"),
    (dict(max_tokens=-1), "max_tokens"), (dict(logprobs=21), "logprobs"), (dict(extra_body={"top_k": -2}), "top_k"),
    (dict(extra_body={"min_p": 2}), "min_p"), (dict(stop=[""]), "stop"), (dict(seed=2 ** 70), "seed"),
    (dict(extra_body={"stop_token_ids": [10 ** 9]}), "stop_token_ids"), (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(extra_body={"min_tokens": 9}, max_tokens=2), "min_tokens"), (dict(frequency_penalty="x"), "frequency_penalty"),
    (dict(stream_options={"include_usage": True}), "stream_options"), (dict(extra_body={"temperature": "hot"}), "temperature"),
])
def test_bad_parameters_are_400(srv, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        srv.client().completions.create(model="smol", prompt="hi", **{"max_tokens": 2, **kw})
    assert e.value.status_code == 400 and e.value.param == param, e.value.body
    assert set(e.value.body) == {"message", "type", "param", "code"}


def test_unknown_model_404_and_unknown_fields_ignored(srv):
    c = srv.client()
    with pytest.raises(openai.NotFoundError) as e:
        c.completions.create(model="gpt-5", prompt="hi", max_tokens=1)
    assert e.value.param == "model" and e.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError) as e:
        c.chat.completions.create(model="gpt-5", messages=[{"role": "user", "content": "x"}], max_tokens=1)
    assert e.value.param == "model"
    ok = c.completions.create(model="smol", prompt="hi", max_tokens=1, extra_body={"some_future_field": [1, {"a": 2}]})
    assert ok.usage.completion_tokens == 1


def test_context_length_errors(srv):
    c = srv.client()
    long_ids = [100] * (MAX_MODEL_LEN + 3)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="smol", prompt=long_ids, max_tokens=1)
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="smol", prompt="hi", max_tokens=MAX_MODEL_LEN)
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in e.value.message and e.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="smol", messages=[{"role": "user", "content": "word " * 300}], max_tokens=1)
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in e.value.message


def test_api_key(srv):
    s = live(api_key="sekret-key")
    with pytest.raises(openai.AuthenticationError) as e:
        s.client(api_key="wrong").models.list()
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    for headers in ({}, {"Authorization": "Bearer sekret-ke"}, {"Authorization": "sekret-key"},
                    {"Authorization": "Bearer sekret-key2"}, {"Authorization": "Basic sekret-key"}):
        assert request(s.port, "POST", "/v1/completions", {"prompt": "x"}, headers)[0] == 401
        assert request(s.port, "POST", "/tokenize", {"prompt": "x"}, headers)[0] == 401
    assert [m.id for m in s.client(api_key="sekret-key").models.list().data] == NAMES
    assert request(s.port, "GET", "/health")[0] == 200 and request(s.port, "GET", "/metrics")[0] == 200


def test_queue_full_is_429_with_retry_after(srv):
    s = live(max_num_seqs=1, max_queued_requests=0)
    c = s.client()
    stream = c.completions.create(model="smol", prompt="Count: 1, 2,", max_tokens=200, stream=True, **GREEDY,
                                  extra_body={"ignore_eos": True})
    first = next(iter(stream))                      # the one slot is taken
    assert first.choices
    with pytest.raises(openai.RateLimitError) as e:
        c.completions.create(model="smol", prompt="hi", max_tokens=1)
    assert e.value.status_code == 429 and int(e.value.response.headers["retry-after"]) >= 1
    stream.close()                                  # a disconnect: the request is aborted
    assert_clean(s)
    assert c.completions.create(model="smol", prompt="hi", max_tokens=1).usage.completion_tokens == 1


def test_caps_body_header_n(srv):
    small = live(max_request_body_bytes=2000)
    status, _, body = request(small.port, "POST", "/v1/completions", {"prompt": "x" * 3000, "max_tokens": 1})
    assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"
    status, _, body = request(srv.port, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 1},
                              headers={"X-Big": "a" * 40_000})
    assert status == 431 and json.loads(body)["error"]["code"] == "request_header_fields_too_large"
    with pytest.raises(openai.BadRequestError):
        srv.client().completions.create(model="smol", prompt=["a"] * 65, n=2, max_tokens=1)


def test_no_422_and_no_500_for_bad_bodies(srv):
    for raw in (b"", b"{", b"[]", b"null", b'{"prompt": NaN}', b'{"prompt": "x", "max_tokens": 1e999}',
                b"\xff\xfe", b'{"prompt": "\\ud800"}', b'{"prompt": [[]]}', b'{"prompt": [1, "a"]}',
                b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}",
                b'{"messages": [{"role": "user", "content": null}]}'):
        for path in ("/v1/completions", "/v1/chat/completions") + (("/tokenize",) if b"max_tokens" not in raw else ()):
            status, _, body = request(srv.port, "POST", path, raw=raw)
            assert status == 400, (path, raw[:40], status, body[:200])
            err = json.loads(body)["error"]
            assert set(err) == {"message", "type", "param", "code"}


# -- chat templates -------------------------------------------------------------------------------
@backend_specific
def test_chat_template_matches_hf(srv):
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(str(backend().model_dir))
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi ünïcödé 日本"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Again"}]
    template = ("{%- for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}\n"
                "  <{{ m.role }}>{{ m.content | tojson }}\n{% if loop.index > 9 %}{% break %}{% endif %}"
                "{%- endfor %}\n{% if add_generation_prompt %}<go>{{ extra | default('none') }}{% endif %}")
    for tpl, kwargs in ((None, {}), (template, {"extra": "yes"})):
        want = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False,
                                      **({"chat_template": tpl} if tpl else {}), **kwargs)
        body = {"messages": msgs, "return_token_strs": True, "chat_template_kwargs": kwargs}
        if tpl:
            body["chat_template"] = tpl
        status, _, got = request(srv.port, "POST", "/tokenize", body)
        assert status == 200, got
        got = json.loads(got)
        assert got["tokens"] == hf(want, add_special_tokens=False)["input_ids"]


def test_chat_template_kwargs_and_errors(srv):
    tpl = "{% if enable_thinking %}<think>{% else %}<nothink>{% endif %}{{ messages[0]['content'] }}"
    for flag, want in ((True, "<think>"), (False, "<nothink>")):
        s, _, body = request(srv.port, "POST", "/tokenize", {
            "messages": [{"role": "user", "content": "x"}], "chat_template": tpl, "return_token_strs": True,
            "chat_template_kwargs": {"enable_thinking": flag}})
        assert s == 200 and "".join(json.loads(body)["token_strs"]).startswith(want)
    c = srv.client()
    for bad_tpl, word in (("{{ raise_exception('no system role') }}", "no system role"),
                          ("{% for %}", "does not compile"), ("{{ messages.__class__.__mro__ }}", "")):
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="smol", messages=[{"role": "user", "content": "x"}], max_tokens=1,
                                      extra_body={"chat_template": bad_tpl})
        assert word in e.value.message
    if current().real:      # SmolLM2's template concatenates content: a null one (a tool-calling turn) is ""
        out = c.chat.completions.create(model="smol", messages=[{"role": "assistant", "content": None}], max_tokens=1)
        assert out.choices[0].finish_reason in ("stop", "length")
    strict = live(trust_request_chat_template=False)
    with pytest.raises(openai.BadRequestError) as e:
        strict.client().chat.completions.create(model="smol", messages=[{"role": "user", "content": "x"}],
                                                max_tokens=1, extra_body={"chat_template": "{{ 1 }}"})
    assert e.value.param == "chat_template"


# -- tokenizer endpoints, models, metrics, health ---------------------------------------------------
@backend_specific
def test_tokenize_detokenize_tokenizer_info_models(srv):
    tok = backend().tokenizer
    s, _, body = request(srv.port, "POST", "/tokenize", {"model": "smol", "prompt": "Hello world",
                                                         "return_token_strs": True})
    got = json.loads(body)
    assert s == 200 and got["tokens"] == tok.encode("Hello world") and got["count"] == len(got["tokens"])
    assert got["max_model_len"] == MAX_MODEL_LEN and "".join(got["token_strs"]) == "Hello world"
    s, _, body = request(srv.port, "POST", "/detokenize", {"tokens": got["tokens"]})
    assert s == 200 and json.loads(body)["prompt"] == "Hello world"
    assert request(srv.port, "POST", "/detokenize", {"tokens": [-1]})[0] == 400
    assert request(srv.port, "POST", "/tokenize", {"model": "other", "prompt": "x"})[0] == 404
    s, _, body = request(srv.port, "GET", "/tokenizer_info")
    info = json.loads(body)
    assert s == 200 and info["eos_token"] == "<|im_end|>" and info["model_max_length"] == MAX_MODEL_LEN
    assert "for message in messages" in info["chat_template"] and info["tokenizer_class"]
    models = srv.client().models.list().data
    assert [m.id for m in models] == NAMES and models[0].model_extra["max_model_len"] == MAX_MODEL_LEN
    assert srv.client().models.retrieve("smol-alias").id == "smol-alias"


def _metrics(port) -> dict:
    s, _, body = request(port, "GET", "/metrics")
    assert s == 200
    out = {}
    for line in body.decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_metrics(srv):
    before = _metrics(srv.port)
    srv.client().completions.create(model="smol", prompt=PROMPT, max_tokens=3, extra_body={"ignore_eos": True},
                                    **GREEDY)
    after = _metrics(srv.port)
    lab = '{model_name="smol"}'
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens_total",
                 "generation_tokens_total", "num_preemptions_total"):
        assert f"vllm:{name}{lab}" in after, name
    assert after[f"vllm:generation_tokens_total{lab}"] - before[f"vllm:generation_tokens_total{lab}"] == 3
    assert after[f"vllm:prompt_tokens_total{lab}"] - before[f"vllm:prompt_tokens_total{lab}"] == n_prompt()
    key = 'vllm:request_success_total{finished_reason="length",model_name="smol"}'
    assert after[key] - before.get(key, 0) == 1
    assert after[f"vllm:num_requests_running{lab}"] == 0
    for h in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
              "request_queue_time_seconds"):
        buckets = [(k, v) for k, v in after.items() if k.startswith(f"vllm:{h}_bucket")]
        assert len(buckets) > 5 and buckets[-1][0].startswith(f'vllm:{h}_bucket{{le="+Inf"')
        assert all(a[1] <= b[1] for a, b in zip(buckets, buckets[1:]))            # cumulative
        assert buckets[-1][1] == after[f"vllm:{h}_count{lab}"] > 0 and f"vllm:{h}_sum{lab}" in after
    assert after[f"vllm:e2e_request_latency_seconds_count{lab}"] - before[f"vllm:e2e_request_latency_seconds_count{lab}"] == 1


def test_health_while_loading_then_ready():
    state = ServerState(ServerConfig(served_model_names=["m"]))
    t = ServerThread(make_app(state)).start()
    try:
        s, h, body = request(t.port, "GET", "/health")
        assert s == 503 and "retry-after" in {k.lower() for k in h}
        assert request(t.port, "POST", "/v1/completions", {"prompt": "x"})[0] == 503
        assert request(t.port, "GET", "/metrics")[0] == 200
        state.attach(backend())
        assert request(t.port, "GET", "/health")[0] == 200
    finally:
        t.stop()


def test_tcp_nodelay(srv):
    import http.client
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
    try:
        conn.request("GET", "/health")
        conn.getresponse().read()
        socks = [p.transport.get_extra_info("socket") for p in srv.thread.server.server_state.connections]
        assert socks and all(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for s in socks)
    finally:
        conn.close()


# -- a scripted runner: exact UTF-8 splits, and an engine that dies mid-stream ----------------------
class DeviceFailure(RuntimeError):
    engine_fatal = True          # as CudaError: the engine cannot go on (engine.is_fatal)


class ScriptedRunner:
    """Emits a fixed token script; raises a fatal error on step `fail_at` (1-based)."""

    def __init__(self, script, vocab_size, fail_at=None):
        self.script, self.vocab_size, self.fail_at = script, vocab_size, fail_at
        self.num_pages, self.page_size, self.calls = 64, 16, 0

    def execute(self, meta, sampling):
        self.calls += 1
        if self.fail_at is not None and self.calls >= self.fail_at:
            raise DeviceFailure("scripted device failure")
        return [None if s is None else Sample(self.script[s.step % len(self.script)], -0.5,
                                              [(self.script[s.step % len(self.script)], -0.5)])
                for s in sampling]


def _scripted_server(script, fail_at=None):
    real = backend()
    tok = real.tokenizer
    runner = ScriptedRunner(script, real.vocab_size, fail_at)
    engine = AsyncEngine(Engine(runner, tok, {2}, 256, max_num_seqs=8))
    b = Backend(engine, tok, real.model_dir, "scripted", "cpu", 256, real.vocab_size, 1024, 16, {2},
                tok.config)
    state = ServerState(ServerConfig(served_model_names=["s"]), b)
    srv = ServerThread(make_app(state)).start()
    srv.state = state                                   # (admission's count, for the tests)
    return srv, engine


def _sse_events(raw: bytes) -> list:
    assert raw.endswith(b"data: [DONE]\n\n"), raw[-80:]
    events = [e for e in raw.split(b"\n\n") if e]
    for e in events:
        assert e.startswith(b"data: ")
        e.decode("utf-8")                               # strict: every event is valid UTF-8
    return [json.loads(e[6:]) for e in events[:-1]]


def test_stream_is_valid_utf8_when_tokens_split_characters():
    tok = backend().tokenizer
    # byte-level BPE: one token per byte of "日本" (3 bytes each), so each character spans 3 tokens
    byte_tokens = [tok.tk.token_to_id(ch) for ch in "æĹ¥æľ¬"]
    assert None not in byte_tokens and tok.decode(byte_tokens) == "日本"
    t, engine = _scripted_server(byte_tokens)
    try:
        s, _, raw = request(t.port, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 12, "stream": True,
                                                                "ignore_eos": True})
        texts = [c["choices"][0]["text"] for c in _sse_events(raw) if c["choices"]]
        assert s == 200 and "".join(texts) == "日本日本" and all("\ufffd" not in x for x in texts)
    finally:
        t.stop()
        engine.shutdown()


def test_engine_death_mid_stream_then_health_503():
    tok = backend().tokenizer
    t, engine = _scripted_server(tok.encode(" hello world again"), fail_at=3)
    try:
        s, _, raw = request(t.port, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 10, "stream": True,
                                                                "ignore_eos": True})
        events = _sse_events(raw)
        assert s == 200 and events[0]["choices"][0]["text"]          # tokens came, then the failure
        assert set(events[-1]) == {"error"} and "scripted device failure" in events[-1]["error"]["message"]
        assert not engine.healthy
        s, h, _ = request(t.port, "GET", "/health")
        assert s == 503 and "retry-after" in {k.lower() for k in h}
        s, _, body = request(t.port, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert s == 503 and json.loads(body)["error"]["code"] == "engine_dead"
    finally:
        t.stop()
        engine.shutdown()


def test_an_engine_that_dies_as_a_request_is_queued_answers_503_and_holds_nothing(monkeypatch):
    """The worker pool queues a checked request (AsyncEngine.open); an engine found dead there
    (after the route's own health look) is a 503 engine_dead, as a dead engine is before, and the
    request's admission is given back."""
    tok = backend().tokenizer
    t, engine = _scripted_server(tok.encode(" hello"))

    def dead(*a, **k):
        raise EngineDeadError("the engine died: scripted")
    monkeypatch.setattr(engine, "open", dead)
    try:
        for stream in (False, True):
            s, _, body = request(t.port, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 2,
                                                                    "stream": stream})
            assert s == 503 and json.loads(body)["error"]["code"] == "engine_dead", body
            assert t.state.inflight_seqs == 0
        monkeypatch.undo()
        s, _, body = request(t.port, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert s == 200 and t.state.inflight_seqs == 0, body   # every admission given back
    finally:
        t.stop()
        engine.shutdown()


def test_no_pickle_in_the_server():
    from pathlib import Path
    import infc.server
    for f in Path(infc.server.__file__).parent.glob("*.py"):
        assert "pickle" not in f.read_text().replace("no pickle", ""), f


@backend_specific
def test_suite_leaves_engine_clean(srv):
    assert_clean(srv)
