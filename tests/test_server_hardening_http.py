"""Issue 39, HTTP: JSON routes refuse every non-JSON Content-Type (and none at all) with 415 in
OpenAI's error shape, the CSRF vector of a cross-origin text/plain or form POST; what the HTTP parser itself
answers for a malformed request (documented in server/app.py); and admission by cost: an
echo + logprobs request counts the engine requests that score its prompt. Against the real
SmolLM2 on the CPU."""
import http.client
import json
import socket
import time

import pytest

from infc.server import admission
from infc.server.protocol import GenRequest
from test_server_support import assert_clean, live, one_blas_thread, request  # noqa: F401

BODIES = {
    "/v1/completions": {"model": "smol", "prompt": "hi", "max_tokens": 1},
    "/v1/chat/completions": {"model": "smol", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    "/tokenize": {"model": "smol", "prompt": "hi"},
    "/detokenize": {"model": "smol", "tokens": [1, 2]},
}


def post(port, path, body: dict, content_type: str | None):
    """(status, body) of a POST with exactly this Content-Type header (None: no header at all)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", path, body=json.dumps(body).encode(),
                     headers={} if content_type is None else {"Content-Type": content_type})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


@pytest.mark.parametrize("content_type", ["text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/xml", "text/json", None, ""])
def test_non_json_content_types_are_415(content_type):
    s = live()
    for path, body in BODIES.items():
        status, raw = post(s.port, path, body, content_type)
        assert status == 415, (path, content_type, status, raw[:200])
        err = json.loads(raw)["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == "unsupported_media_type"
        assert "application/json" in err["message"]


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8", "Application/JSON",
                                          "application/vnd.api+json"])
def test_json_content_types_are_served(content_type):
    s = live()
    for path, body in BODIES.items():
        status, raw = post(s.port, path, body, content_type)
        assert status == 200, (path, content_type, status, raw[:200])


def test_parser_rejections_are_plain_text_400():
    """What app.py's docstring says a client sees when the HTTP parser rejects the request itself."""
    s = live()
    unfinished_big_header = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (2 * s.config.max_header_bytes)
    for raw in (b"GARBAGE\r\n\r\n", b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n", unfinished_big_header):
        with socket.create_connection(("127.0.0.1", s.port), timeout=10) as sock:
            sock.sendall(raw)
            got = b""
            while chunk := sock.recv(65536):
                got += chunk
        head, _, body = got.partition(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        headers = {k.lower(): v.strip() for k, v in (h.split(":", 1) for h in lines[1:])}
        assert lines[0] == "HTTP/1.1 400 Bad Request", got
        assert headers["content-type"] == "text/plain; charset=utf-8" and headers["connection"] == "close"
        assert body == b"Invalid HTTP request received."


# -- admission by cost ------------------------------------------------------------------------------
def _req(prompts, n=1, echo=False, logprobs=None):
    return GenRequest("completion", prompts, [None] * len(prompts), None, n, echo, logprobs)


class _Engine:
    def __init__(self, scores_prompts):
        self.scores_prompts = scores_prompts


def test_cost_counts_prompt_scoring():
    """Where the engine cannot score prompt rows, echo + logprobs costs its forced-token requests
    (one per prompt token after the first); where it can, its prefill scores them: nothing more."""
    for engine in (None, _Engine(False)):
        assert admission.cost(_req([[1] * 5, [1] * 3], n=2), engine) == 4
        assert admission.cost(_req([[1] * 5, [1] * 3], n=2, echo=True), engine) == 4          # no logprobs
        assert admission.cost(_req([[1] * 5, [1] * 3], n=2, logprobs=1), engine) == 4         # no echo
        assert admission.cost(_req([[1] * 5, [1] * 3], n=2, echo=True, logprobs=0), engine) == 4 + 4 + 2
        assert admission.cost(_req([[7]], echo=True, logprobs=2), engine) == 1
    assert admission.cost(_req([[1] * 5, [1] * 3], n=2, echo=True, logprobs=0), _Engine(True)) == 4


def test_echo_logprobs_costs_one_sequence():
    """The prefill that reads the prompt scores it: an echo + logprobs request of 12 tokens is one
    sequence (the forced-token path's 12 would be refused at a capacity of 2 with one in flight)."""
    s = live(max_num_seqs=1, max_queued_requests=1)            # capacity 2 sequences
    ids = list(range(1000, 1012))
    scored = {"model": "smol", "prompt": ids, "max_tokens": 1, "echo": True, "logprobs": 1, "temperature": 0}
    hold = http.client.HTTPConnection("127.0.0.1", s.port, timeout=120)
    hold.request("POST", "/v1/completions", headers={"Content-Type": "application/json"}, body=json.dumps(
        {"model": "smol", "prompt": "Count: 1, 2,", "max_tokens": 200, "stream": True, "ignore_eos": True,
         "temperature": 0}).encode())
    r = hold.getresponse()
    assert r.status == 200 and r.readline().startswith(b"data: ")            # one sequence in flight
    try:
        status, headers, body = request(s.port, "POST", "/v1/completions", scored, timeout=300)
        assert status == 200, body[:300]
        assert len(json.loads(body)["choices"][0]["logprobs"]["token_logprobs"]) == len(ids) + 1
    finally:
        hold.close()                                           # a disconnect: the stream is aborted
    t0 = time.monotonic()
    while s.state.inflight_seqs and time.monotonic() - t0 < 30:
        time.sleep(0.05)
    assert_clean(s)
