"""Shared by the server tests (no tests here): one backend per model per test process, served on
127.0.0.1 by uvicorn in a thread, plus helpers to look inside its engine.

Without variables the suite's models are the real SmolLM2-135M (the default: what test_server_fuzz,
test_server_disconnect and test_server_cli serve) and two tiny random models of the families whose
engines differ, each with the real Qwen tokenizer (tools/qwen_tokenizer.py) and vocab_size its
size: a Qwen3_5ForCausalLM (tests/test_qwen3_5.py's: Gated DeltaNet layers with per-sequence state
slots; the engine turns prefix caching off) and a DeepSeek-V2 with q_lora and group-limited routing
(tests/test_deepseek_v2.py's "qlora": the latent KV cache), all on the CPU. test_server.py runs
once per model (its `srv` fixture is parametrized over MODELS; `-k qwen3_5` selects one).
Or any one model directory on any device:
    INFC_SERVER_MODEL=/tmp/infc-models/qwen3-4b INFC_SERVER_DEVICE=cuda pytest tests/test_server.py
(the GPU run, with random weights), over rank processes with INFC_SERVER_TP=N (vLLM's
--tensor-parallel-size), INFC_SERVER_EP=1 (--enable-expert-parallel) and INFC_SERVER_DP=N
(--data-parallel-size, with EP: attention data-parallel ranks). What only a real model
knows (a greedy " Paris") is asserted only when the model is SmolLM2 (current().real); everything
else the suite derives from the model's own outputs."""
import atexit
import contextlib
import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from infc.server.app import ServerConfig, ServerState, make_app
from infc.backend import load_backend
from infc.server.serve import ServerThread

MAX_MODEL_LEN = 256
MODEL_DIR = os.environ.get("INFC_SERVER_MODEL")
DEVICE = os.environ.get("INFC_SERVER_DEVICE", "cpu")
PARALLEL = dict(tensor_parallel_size=int(os.environ.get("INFC_SERVER_TP", "1")),
                enable_expert_parallel=os.environ.get("INFC_SERVER_EP", "0") == "1",
                data_parallel_size=int(os.environ.get("INFC_SERVER_DP", "1")))
# token ids at or above this are out of the default model's vocabulary (the fuzz's bad ids)
VOCAB_SIZE = 49152 if MODEL_DIR is None else json.loads((Path(MODEL_DIR) / "config.json").read_text())["vocab_size"]
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


@dataclass(frozen=True)
class ServerModel:
    name: str
    real: bool                   # SmolLM2's real weights: its greedy answers are known
    serial: bool                 # compared requests one at a time, prefix cache off (see MODELS)
    make: Callable[[], Path]     # -> the model directory (made once per process)


def _qwen_tokenizer_into(d: Path) -> int:
    """The repo's Qwen tokenizer (tokenizer.json, tokenizer_config.json) written into d; returns
    its size (the tiny model's vocab_size)."""
    from test_qwen_tokenizer import qt
    qt.write_qwen_tokenizer(d)
    return max(tid for _, tid, _ in qt.ADDED_TOKENS) + 1


def _qwen_token_ids(d: Path):
    """After save_pretrained: config.json's and generation_config.json's token ids those of a Qwen3
    chat model's tokenizer, not the HF class defaults (DeepSeek-V2's eos 100001)."""
    from test_qwen_tokenizer import qt
    im_end, endoftext = qt.SPECIAL_TOKENS["<|im_end|>"], qt.SPECIAL_TOKENS["<|endoftext|>"]
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(eos_token_id=im_end, bos_token_id=None, pad_token_id=endoftext)
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [im_end, endoftext],
                                                          "pad_token_id": endoftext}))


def tiny_qwen3_dir(d: Path, seed: int, max_len: int) -> Path:
    """A 2-layer float32 Qwen3 of the repo's Qwen tokenizer (its vocabulary, its chat token ids)
    saved into d: the server's LoRA and feature-combination fixtures."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    vocab = _qwen_tokenizer_into(d)
    torch.manual_seed(seed)
    Qwen3ForCausalLM(Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                 max_position_embeddings=max_len, tie_word_embeddings=True)).float().save_pretrained(d)
    _qwen_token_ids(d)
    return d


def _tmp_dir(name: str) -> Path:
    d = Path(tempfile.mkdtemp(prefix=f"infc-server-{name}-"))
    atexit.register(shutil.rmtree, d, True)
    return d


def _smollm2() -> Path:
    from smollm2_from_gguf import ensure_smollm2
    return ensure_smollm2()


def _tiny_qwen3_5() -> Path:
    import torch
    from test_qwen3_5 import _causal, _randomize
    d = _tmp_dir("qwen3_5")
    vocab = _qwen_tokenizer_into(d)
    torch.manual_seed(1234)
    model = _causal(vocab_size=vocab).float().eval()
    _randomize(model)
    model.save_pretrained(d)
    _qwen_token_ids(d)
    return d


def _tiny_deepseek_v2() -> Path:
    from test_deepseek_v2 import make
    d = _tmp_dir("deepseek_v2")
    make("qlora", d, vocab_size=_qwen_tokenizer_into(d))
    _qwen_token_ids(d)
    return d


# serial: outputs compared across requests stay equal under concurrency only with a confident model:
# on a GPU a row batched with others, or over cached prefix pages, takes another kernel path, and a
# random-weight model's near-tied logits (gaps of 0.005-0.07 nat) flip with the rounding. With
# random weights from INFC_SERVER_MODEL the suite sends compared requests one at a time and turns
# the prefix cache off (the GPU suite covers both: prefix replays, 1000 requests with shared
# prefixes, 50 clients). The tiny models run float32 numpy on the CPU, where a row's logits do not
# move with its batch (their flat 151k-token distributions included): their requests share steps
# (and DeepSeek-V2's cached latent pages), as SmolLM2's do.
if MODEL_DIR is None:
    MODELS = {m.name: m for m in (
        ServerModel("smollm2", real=True, serial=False, make=_smollm2),
        ServerModel("qwen3_5", real=False, serial=DEVICE != "cpu", make=_tiny_qwen3_5),
        ServerModel("deepseek_v2", real=False, serial=DEVICE != "cpu", make=_tiny_deepseek_v2))}
else:
    MODELS = {Path(MODEL_DIR).name: ServerModel(Path(MODEL_DIR).name, real=False, serial=True,
                                                make=lambda: Path(MODEL_DIR))}
DEFAULT = next(iter(MODELS))
_current = [DEFAULT]


def use_model(name: str | None):
    """backend(), live() and current() serve this model from now on (None: the default)."""
    _current[0] = name or DEFAULT


def current() -> ServerModel:
    return MODELS[_current[0]]


def backend(name: str | None = None):
    """The backend of this model (default: the current one), loaded once per process."""
    m = MODELS[name or _current[0]]
    with _lock:
        key = ("backend", m.name)
        if key not in _live:
            kv = {"kv_cache_memory_bytes": 64 << 20} if DEVICE == "cpu" else {"num_gpu_blocks_override": 2048}
            _live[key] = load_backend(m.make(), device=DEVICE, max_model_len=MAX_MODEL_LEN, max_num_seqs=64,
                                      enable_prefix_caching=not m.serial, log=None, **kv, **PARALLEL)
        return _live[key]


def live(**config) -> Live:
    """The current model's shared server (default config), or a new one over the same backend with
    this config."""
    key = (_current[0],) + tuple(sorted(config.items()))
    with _lock:
        have = _live.get(key)
    if have is None:
        cfg = dict(served_model_names=NAMES, trust_request_chat_template=True, max_num_seqs=64)
        cfg.update(config)
        have = Live(backend(), ServerConfig(**cfg))
        with _lock:
            _live[key] = have
    return have


def per_model_srv(names, fast=None):
    """A module's `srv` fixture over these models of MODELS: each test taking it runs once per
    model (pytest groups a module's tests by model, so each backend and server starts once). A
    model outside `fast` (None: all fast) is marked other_server_model: there the fast suite runs
    only the tests marked backend_specific, the others with --exhaustive (tests/conftest.py)."""
    params = [name if fast is None or name in fast else pytest.param(name, marks=pytest.mark.other_server_model)
              for name in names]

    @pytest.fixture(scope="module", params=params)
    def srv(request):
        use_model(request.param)
        yield live()
        use_model(None)
    return srv


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
    assert e.bm.num_free_slots == e.bm.num_slots, (e.bm.num_free_slots, e.bm.num_slots)   # state slots (hybrid)
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


@contextlib.contextmanager
def serve_process(model_dir, *flags, timeout=180):
    """`infc serve --model-path model_dir --port 0 flags...` in a child process: yields (port, its
    output up to the `serving` line); stopped with SIGINT as a user would."""
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "infc.cli", "serve", "--model-path", str(model_dir), "--port", "0", *flags]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                         cwd=Path(__file__).resolve().parent.parent)
    lines = []
    try:
        t0 = time.monotonic()
        while not any(line.startswith("serving") for line in lines):
            assert time.monotonic() - t0 < timeout and p.poll() is None, "".join(lines)
            lines.append(p.stdout.readline())
        yield int(lines[-1].rsplit(":", 1)[1]), "".join(lines)
    finally:
        p.send_signal(signal.SIGINT)
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


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
    """The default model's server (test_server.py's own `srv` runs over every model in MODELS)."""
    use_model(None)
    return live()


def run_together(fns, timeout: float | None = None) -> list:
    """Run the calls at once, a thread each (they share the engine's steps); their results in
    order, the first error raised."""
    out, errs = [None] * len(fns), []

    def run(i, f):
        try:
            out[i] = f()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errs.append(e)

    ts = [threading.Thread(target=run, args=(i, f)) for i, f in enumerate(fns)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout)
    if errs:
        raise errs[0]
    return out
