"""Issue 39: one large request never stalls the server. Against the real SmolLM2 on the CPU: a
~15 MB text prompt (under the 16 MiB body cap) is refused with the context-length 400 while
/health and a concurrent small stream keep answering within 100 ms, and refused prompts give
their memory back; tokenization itself runs off the event loop (a tokenizer slowed to a second
per call leaves /health answering), including a prompt just under the cheap character bound that
is over the context once tokenized.

The budget is 100 ms. What a Python server can promise under load: its threads share one GIL
and, here, 2 cores with other jobs (load average 12-13 when measured), so an idle server's
/health already peaks at 56-85 ms; with the 15 MB prompts in flight (paced probes) /health
measured p50 20-23 ms, max 55-240 ms, and a small stream's first chunk p50 56-72 ms, max
176-250 ms (json.loads of the body holds the GIL 20-45 ms; the OS preempting a thread that holds
it makes the tail). So the median must meet the budget and no probe may exceed 1 s; before the
fix each refusal held the event loop ~15 s (/health: 15.3 s)."""
import dataclasses
import gc
import http.client
import json
import threading
import time
import tracemalloc

from infc.server.app import ServerConfig
from test_server_support import (MAX_MODEL_LEN, NAMES, Live, backend, live, one_blas_thread,  # noqa: F401
                                 request)

BUDGET_S = 0.100                 # the median probe
WORST_S = 1.0                    # every probe
BIG_PROMPT = "hello world " * 1_250_000          # 15,000,000 characters


def _health_latency(port) -> float:
    t0 = time.perf_counter()
    status, _, _ = request(port, "GET", "/health", timeout=30)
    assert status == 200
    return time.perf_counter() - t0


def _stream_first_chunk_latency(port) -> float:
    """Seconds until a small chat stream's first SSE event (the role chunk) arrives."""
    body = json.dumps({"model": "smol", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
                       "stream": True, "temperature": 0}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        t0 = time.perf_counter()
        conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200
        line = r.readline()
        took = time.perf_counter() - t0
        assert line.startswith(b"data: "), line
        return took                                 # closing the connection aborts the request
    finally:
        conn.close()


def _probe_while(port, busy: threading.Event, done: threading.Event) -> tuple[list, list]:
    """/health latencies (one thread) and small streams' first-chunk latencies (another),
    measured from when `busy` is set until `done` is."""
    health, stream = [], []

    def probe(fn, out, pause):
        busy.wait(60)
        while not done.is_set():
            out.append(fn(port))
            time.sleep(pause)          # paced: the probes themselves must not load the 2 cores
    threads = [threading.Thread(target=probe, args=a) for a in ((_health_latency, health, 0.01),
                                                                 (_stream_first_chunk_latency, stream, 0.05))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return health, stream


def _send_all(port, path, bodies: list[bytes], busy: threading.Event, done: threading.Event, out: list):
    try:
        for raw in bodies:
            busy.set()
            out.append(request(port, "POST", path, raw=raw, timeout=120))
    finally:
        done.set()


def test_a_15_mb_prompt_is_refused_while_health_and_streams_answer():
    s = live()
    raw = json.dumps({"model": "smol", "prompt": BIG_PROMPT, "max_tokens": 1}).encode()
    assert 14_000_000 < len(raw) < s.config.max_request_body_bytes
    _stream_first_chunk_latency(s.port)             # warm: the first chat request compiles the template
    busy, done, results = threading.Event(), threading.Event(), []
    sender = threading.Thread(target=_send_all, args=(s.port, "/v1/completions", [raw] * 3, busy, done, results))
    sender.start()
    health, stream = _probe_while(s.port, busy, done)
    sender.join()
    for status, _, body in results:
        err = json.loads(body)["error"]
        assert status == 400 and err["code"] == "context_length_exceeded" and err["param"] == "prompt", err
        assert f"maximum context length is {MAX_MODEL_LEN} tokens" in err["message"]
    assert health and stream
    _within_budget("/health", health)
    _within_budget("a small stream's first chunk", stream)


def _within_budget(what: str, took: list):
    took = sorted(took)
    median, worst = took[len(took) // 2], took[-1]
    assert median < BUDGET_S and worst < WORST_S, \
        f"{what} took {median * 1e3:.0f} ms (median), {worst * 1e3:.0f} ms (max) over {len(took)} probes"


def _rss_bytes() -> int:
    """This process's resident bytes after freed heap is handed back to the OS (glibc keeps freed
    blocks in per-thread arenas: what is measured is what is still referenced, not that slack)."""
    import ctypes
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_refused_large_prompts_give_their_memory_back():
    s = live()
    assert request(s.port, "POST", "/v1/completions", {"model": "smol", "prompt": "hi", "max_tokens": 1})[0] == 200
    raw = json.dumps({"model": "smol", "prompt": BIG_PROMPT, "max_tokens": 1}).encode()
    chat = json.dumps({"model": "smol", "messages": [{"role": "user", "content": BIG_PROMPT}]}).encode()

    def refuse(rounds):
        for _ in range(rounds):
            for path, body in (("/v1/completions", raw), ("/v1/chat/completions", chat)):
                status, _, out = request(s.port, "POST", path, raw=body, timeout=120)
                assert status == 400 and json.loads(out)["error"]["code"] == "context_length_exceeded"

    refuse(1)                    # the worker threads' first touch of a 15 MB body is not a leak
    gc.collect()
    rss_before = _rss_bytes()
    tracemalloc.start()          # every Python allocation made from here on that is still alive
    try:
        refuse(3)
        # a worker thread may still be unwinding the last request after its response is sent (a
        # loaded machine: 43 MiB seen once): a body kept for good is still there 10 s later
        for _ in range(50):
            gc.collect()
            kept = tracemalloc.get_traced_memory()[0]
            if kept < 16 << 20:
                break
            time.sleep(0.2)
    finally:
        tracemalloc.stop()
    rss_grown = _rss_bytes() - rss_before
    # six more 15 MB prompts refused: nothing of them stays referenced (a kept body is 15 MB)...
    assert kept < 16 << 20, f"{kept / 2 ** 20:.0f} MiB still referenced after six refused 15 MB prompts"
    # ... and the process does not keep growing by them. RSS also holds what the allocator's
    # per-thread arenas keep for reuse (up to ~70 MiB seen here beside other tests), so its bound
    # is only the failure: hundreds of MiB per refused prompt.
    assert rss_grown < 160 << 20, f"RSS grew {rss_grown / 2 ** 20:.0f} MiB over six refused 15 MB prompts"


class _SlowTokenizer:
    """The real tokenizer, one second slower per encode (as a long prompt on a slow machine)."""

    def __init__(self, tok, delay: float):
        self._tok, self._delay = tok, delay

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def encode(self, text):
        time.sleep(self._delay)
        return self._tok.encode(text)

    def encode_text(self, text):
        time.sleep(self._delay)
        return self._tok.encode_text(text)


def test_tokenization_runs_off_the_event_loop():
    b = backend()
    slow = dataclasses.replace(b, tokenizer=_SlowTokenizer(b.tokenizer, 1.0))
    s = Live(slow, ServerConfig(served_model_names=NAMES, max_num_seqs=64))
    try:
        cap = MAX_MODEL_LEN * max(map(len, b.tokenizer.tk.get_vocab(with_added_tokens=True)))
        text = ("hello world " * (cap // 12 + 1))[:cap]      # at the cheap bound: tokenized
        bodies = [json.dumps({"model": "smol", "prompt": text, "max_tokens": 1}).encode(),
                  json.dumps({"model": "smol", "messages": [{"role": "user", "content": text[:cap - 400]}]}).encode()]
        paths = ["/v1/completions", "/v1/chat/completions"]
        for path, raw in zip(paths, bodies):
            busy, done, out = threading.Event(), threading.Event(), []
            sender = threading.Thread(target=_send_all, args=(s.port, path, [raw], busy, done, out))
            sender.start()
            busy.wait(10)
            health = []
            while not done.is_set():
                health.append(_health_latency(s.port))
            sender.join()
            status, _, body = out[0]
            err = json.loads(body)["error"]
            assert status == 400 and err["code"] == "context_length_exceeded", err
            assert "input tokens" in err["message"], err      # refused after tokenizing, not by the bound
            assert len(health) >= 5, health                  # the refusal took the slow tokenizer's second
            _within_budget(f"/health while {path} tokenized", health)
    finally:
        s.stop()
