"""A storm of generated requests, valid and malformed mixed (tests/fuzz_requests.py), sent by a
pool of clients to the real SmolLM2 server and to a keyed one over the same engine. It passes when
- no request is answered 5xx, or takes more than STALL_S seconds, or goes unanswered;
- every valid request is answered 200 and every request with a bad key 401;
- every 200 is well-formed (choices, usage, a stream of chunks ending in [DONE] without an error
  event, tokenize's count) and every error OpenAI-shaped;
- afterwards /health answers 200, no request or KV page is left in the engine, and the greedy
  output of a fixed prompt is the one it was before the storm.
Failing requests are reported whole (the case index reproduces one: make_case(SEED, index, ...)).

Environment (read here only):
    INFC_FUZZ_COUNT   requests in the storm; default 600 (CI); the acceptance run of issue 39 is
                      INFC_FUZZ_COUNT=10000 (401 s on 2 cores shared with other jobs, load ~10)
    INFC_FUZZ_SEED    the generator's seed; default 39
"""
import collections
import http.client
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from fuzz_requests import API_KEY, MODEL_NAMES, Case, make_case
from test_server_support import (MAX_MODEL_LEN, VOCAB_SIZE, assert_clean, live, one_blas_thread,  # noqa: F401
                                 request, srv)

COUNT = int(os.environ.get("INFC_FUZZ_COUNT", "600"))
SEED = int(os.environ.get("INFC_FUZZ_SEED", "39"))
CLIENTS = 8                  # concurrent clients: valid requests share engine steps, as in service
STALL_S = 30.0               # a request answered later than this is a stall
GREEDY = {"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}
ERROR_KEYS = {"message", "type", "param", "code"}


def send(port: int, case: Case) -> tuple[int | None, dict, bytes, float]:
    """(status, lower-cased headers, body, seconds); status None when no answer came."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2 * STALL_S)
    t0 = time.monotonic()
    try:
        conn.request(case.method, case.path, body=case.raw, headers=case.headers)
        r = conn.getresponse()
        body = r.read()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, body, time.monotonic() - t0
    except (OSError, http.client.HTTPException) as e:
        return None, {}, repr(e).encode(), time.monotonic() - t0
    finally:
        conn.close()


def _error_shape(body: bytes) -> str | None:
    try:
        err = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return "the error body is not {\"error\": {...}}"
    if not isinstance(err, dict) or set(err) != ERROR_KEYS:
        return f"the error object's keys are not {sorted(ERROR_KEYS)}"
    if not isinstance(err["message"], str) or not err["message"] or not isinstance(err["type"], str):
        return "the error has no message or type"
    return None


def _usage(u, choices: int, case: Case) -> str | None:
    if not isinstance(u, dict) or not all(isinstance(u.get(k), int) and u[k] >= 0
                                          for k in ("prompt_tokens", "completion_tokens", "total_tokens")):
        return f"usage is malformed: {u}"
    if u["total_tokens"] != u["prompt_tokens"] + u["completion_tokens"]:
        return f"usage does not add up: {u}"
    if case.must_succeed and u["completion_tokens"] > case.max_tokens * choices:
        return f"{u['completion_tokens']} completion tokens for {choices} choices of at most {case.max_tokens}"
    return None


def _choice(c, chat: bool) -> str | None:
    if not isinstance(c, dict) or not isinstance(c.get("index"), int):
        return f"a choice is malformed: {str(c)[:200]}"
    if chat:
        m = c.get("message")
        if not (isinstance(m, dict) and m.get("role") == "assistant" and isinstance(m.get("content"), str)):
            return f"a chat choice has no assistant message: {str(c)[:200]}"
    elif not isinstance(c.get("text"), str):
        return f"a completion choice has no text: {str(c)[:200]}"
    if c.get("finish_reason") not in ("length", "stop"):
        return f"finish_reason {c.get('finish_reason')!r}"
    return None


def _completion(case: Case, obj) -> str | None:
    chat = case.route == "chat"
    if not isinstance(obj, dict) or obj.get("object") != ("chat.completion" if chat else "text_completion"):
        return "not a completion object"
    if obj.get("model") not in MODEL_NAMES or not isinstance(obj.get("id"), str):
        return "no id or model"
    choices = obj.get("choices")
    if not isinstance(choices, list) or not choices:
        return "no choices"
    for c in choices:
        if (why := _choice(c, chat)) is not None:
            return why
    if sorted(c["index"] for c in choices) != list(range(len(choices))):
        return f"choice indexes {[c['index'] for c in choices]}"
    if case.must_succeed and len(choices) != case.expect_choices:
        return f"{len(choices)} choices, expected {case.expect_choices}"
    return _usage(obj.get("usage"), len(choices), case)


def _stream(case: Case, body: bytes) -> str | None:
    events = body.decode("utf-8").split("\n\n")
    if events[-1] != "" or events[-2] != "data: [DONE]":
        return "the stream does not end with data: [DONE]"
    finished = collections.Counter()
    want = "chat.completion.chunk" if case.route == "chat" else "text_completion"
    for e in events[:-2]:
        if not e.startswith("data: "):
            return f"an event is not data: {e[:100]}"
        obj = json.loads(e[6:])
        if "error" in obj:
            return f"an error event: {e[:300]}"
        if obj.get("object") != want or not isinstance(obj.get("choices"), list):
            return f"a chunk is malformed: {e[:300]}"
        for c in obj["choices"]:
            if c.get("finish_reason") is not None:
                finished[c["index"]] += 1
        if "usage" in obj and (why := _usage(obj["usage"], case.expect_choices or 1, case)) is not None:
            return why
    if case.must_succeed and sorted(finished.elements()) != list(range(case.expect_choices)):
        return f"finish reasons per choice {dict(finished)}, expected one for each of {case.expect_choices}"
    return None


def _ok_body(case: Case, headers: dict, body: bytes) -> str | None:
    ctype = headers.get("content-type", "")
    if ctype.startswith("text/event-stream"):
        if case.route not in ("completions", "chat"):
            return "a stream from a tokenizer route"
        return _stream(case, body)
    if not ctype.startswith("application/json"):
        return f"content-type {ctype!r}"
    obj = json.loads(body)
    if case.stream:
        return "a JSON body for a stream request"
    if case.route in ("completions", "chat"):
        return _completion(case, obj)
    if case.route == "tokenize":
        toks = obj.get("tokens")
        if not (isinstance(toks, list) and all(isinstance(t, int) for t in toks) and obj.get("count") == len(toks)):
            return f"tokenize answered {str(obj)[:200]}"
        return None
    return None if isinstance(obj.get("prompt"), str) else f"detokenize answered {str(obj)[:200]}"


def judge(case: Case, status, headers: dict, body: bytes, seconds: float) -> str | None:
    """Why this answer is wrong, or None."""
    if status is None:
        return f"no answer: {body.decode()}"
    if seconds > STALL_S:
        return f"a stall: answered {status} after {seconds:.1f} s"
    if status >= 500:
        return f"{status}: {body[:400]!r}"
    if case.must_401 and status != 401:
        return f"a request with a {case.auth} key answered {status}, not 401"
    if case.must_succeed and status != 200:
        return f"a valid request answered {status}: {body[:400]!r}"
    if status == 200:
        try:
            return _ok_body(case, headers, body)
        except (ValueError, KeyError, TypeError, IndexError) as e:
            return f"a 200 whose body does not parse ({e!r}): {body[:300]!r}"
    if not 400 <= status < 500:
        return f"status {status}"
    if not headers.get("content-type", "").startswith("application/json"):
        return f"a {status} with content-type {headers.get('content-type')!r}: {body[:200]!r}"
    return _error_shape(body)


def greedy(port: int) -> tuple:
    status, _, body = request(port, "POST", "/v1/completions", GREEDY)
    assert status == 200, body
    out = json.loads(body)
    return out["choices"][0]["text"], out["choices"][0]["finish_reason"], out["usage"]


def test_mixed_request_storm(srv):
    keyed = live(api_key=API_KEY)
    before = greedy(srv.port)
    statuses, by_form, failures = collections.Counter(), collections.Counter(), []
    slowest = [0.0, None]
    lock = threading.Lock()

    def one(i: int):
        case = make_case(SEED, i, VOCAB_SIZE, MAX_MODEL_LEN)
        status, headers, body, seconds = send(keyed.port if case.auth else srv.port, case)
        why = judge(case, status, headers, body, seconds)
        with lock:
            statuses[status] += 1
            by_form[(case.form, status)] += 1
            if seconds > slowest[0]:
                slowest[:] = [seconds, case.index]
            if why is not None:
                failures.append(f"{why}\n    {case.describe()}")

    t0 = time.monotonic()
    with ThreadPoolExecutor(CLIENTS) as pool:
        list(pool.map(one, range(COUNT)))
    elapsed = time.monotonic() - t0
    print(f"\n{COUNT} requests (seed {SEED}) in {elapsed:.1f} s ({COUNT / elapsed:.1f}/s), slowest "
          f"{slowest[0]:.2f} s (case {slowest[1]}); statuses {dict(sorted(statuses.items(), key=str))}; "
          f"by form {dict(sorted(by_form.items(), key=str))}")
    assert not failures, f"{len(failures)} of {COUNT} requests failed:\n" + "\n".join(failures[:30])
    # the generator still makes requests that reach the engine (about 10 %; a quarter of that at least)
    assert sum(n for (form, s), n in by_form.items() if form == "valid" and s == 200) >= COUNT // 40
    for port in (srv.port, keyed.port):
        assert request(port, "GET", "/health")[0] == 200
    assert_clean(srv)
    assert greedy(srv.port) == before
