"""Shared by the server tests (no tests here): one backend per test process, served on 127.0.0.1
by uvicorn in a thread, plus helpers to look inside its engine.

The backend is the real SmolLM2-135M on the CPU (CI), or any model directory on any device:
    INFC_SERVER_MODEL=/tmp/infc-models/qwen3-4b INFC_SERVER_DEVICE=cuda pytest tests/test_server.py
(the GPU run, with random weights). What only a real model knows (a greedy " Paris") is asserted
only when the model is SmolLM2; everything else the suite derives from the model's own outputs."""
import http.client
import json
import os
import threading
import time
from pathlib import Path

import pytest

from infc.server.app import ServerConfig, ServerState, make_app
from infc.backend import load_backend
from infc.server.serve import ServerThread

MAX_MODEL_LEN = 256
MODEL_DIR = os.environ.get("INFC_SERVER_MODEL")
DEVICE = os.environ.get("INFC_SERVER_DEVICE", "cpu")
SMOLLM2 = MODEL_DIR is None                 # the real model: its greedy answers are known
# Outputs compared across requests stay equal under concurrency only with a confident model: on a
# GPU a row batched with others, or over cached prefix pages, takes another kernel path, and a
# random-weight model's near-tied logits (gaps of 0.005-0.07 nat) flip with the rounding. With
# random weights the suite sends compared requests one at a time and turns the prefix cache off
# (the GPU suite covers both: prefix replays, 1000 requests with shared prefixes, 50 clients).
SERIAL = not SMOLLM2
# token ids at or above this are out of the vocabulary (the fuzz's bad ids)
VOCAB_SIZE = 49152 if SMOLLM2 else json.loads((Path(MODEL_DIR) / "config.json").read_text())["vocab_size"]
NAMES = ["smol", "smol-alias"]
_lock = threading.Lock()
_live = {}


class Live:
    def __init__(self, backend, config: ServerConfig):
        self.backend, self.config = backend, config
        self.state = ServerState(config, backend)
        self.thread = ServerThread(make_app(self.state)).start()
        self.url = self.thread.url
        self.port = self.thread.port

    @property
    def engine(self):                  # the runtime Engine (read only, and only when idle)
        return self.backend.engine.engine

    def client(self, **kw):
        from openai import OpenAI
        kw.setdefault("api_key", self.config.api_key or "none")
        return OpenAI(base_url=self.url + "/v1", max_retries=0, timeout=120, **kw)

    def stop(self):
        self.thread.stop()


def backend():
    with _lock:
        if "backend" not in _live:
            if SMOLLM2:
                from smollm2_from_gguf import ensure_smollm2
                model_dir = ensure_smollm2()
            else:
                model_dir = MODEL_DIR
            kv = {"kv_cache_memory_bytes": 64 << 20} if DEVICE == "cpu" else {"num_gpu_blocks_override": 2048}
            _live["backend"] = load_backend(model_dir, device=DEVICE, max_model_len=MAX_MODEL_LEN,
                                            max_num_seqs=64, enable_prefix_caching=not SERIAL, log=None, **kv)
        return _live["backend"]


def live(**config) -> Live:
    """The shared server (default config), or a new one over the same backend with this config."""
    key = tuple(sorted(config.items()))
    with _lock:
        have = _live.get(key)
    if have is None:
        cfg = dict(served_model_names=NAMES, trust_request_chat_template=True, max_num_seqs=64)
        cfg.update(config)
        have = Live(backend(), ServerConfig(**cfg))
        with _lock:
            _live[key] = have
    return have


def wait_idle(engine, timeout=60.0):
    """Until the engine thread has no request left (aborts are applied between steps)."""
    t0 = time.monotonic()
    while engine.has_unfinished() or engine.scheduler.running or engine.scheduler.waiting:
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"the engine still has requests after {timeout} s: "
                                 f"{list(engine.requests)[:5]}")
        time.sleep(0.05)


def assert_clean(live_server: Live, timeout=60.0):
    """Zero running requests and zero referenced KV blocks, from the engine's own state."""
    e = live_server.engine
    wait_idle(e, timeout)
    time.sleep(0.05)
    wait_idle(e, timeout)
    assert not e.requests and not e.scheduler.running and not e.scheduler.waiting
    assert all(b.ref == 0 for b in e.bm.blocks), [b.id for b in e.bm.blocks if b.ref]
    assert e.bm.num_free_pages == e.bm.num_pages
    e.bm.check()
    assert live_server.state.inflight_seqs == 0


def request(port, method, path, body=None, headers=None, raw: bytes | None = None, timeout=60):
    """(status, headers, body bytes) over a fresh connection."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        conn.close()


@pytest.fixture(scope="module", autouse=True)
def one_blas_thread():
    """One BLAS thread while a module of server tests runs: the engine thread, the HTTP thread and
    the clients share 2 cores, and a multi-threaded GEMM among them (or beside other jobs) spins
    and runs several times slower. Restored after the module."""
    from threadpoolctl import threadpool_limits
    limits = threadpool_limits(1, user_api="blas")
    yield
    limits.restore_original_limits()


@pytest.fixture(scope="module")
def srv():
    return live()
