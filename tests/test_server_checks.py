"""The server checks a request once on its way in: app.serve runs the engine's check_request on
every prompt before it replies, and neither the async engine nor the engine repeats it (at 16k
tokens each pass over the ids costs ~0.5 ms of a warm prefix hit's TTFT)."""
import json

from infc.backend import Backend
from infc.runtime.engine.async_engine import AsyncEngine
from infc.runtime.engine.engine import Engine
from infc.server.app import ServerConfig, ServerState, make_app
from infc.server.serve import ServerThread
from test_scheduler import FakeRunner, make_engine
from test_server_support import request


def test_a_served_prompt_is_checked_once(monkeypatch):
    calls = []
    check = Engine.check_request
    monkeypatch.setattr(Engine, "check_request",
                        lambda self, ids, p: (calls.append(len(ids)), check(self, ids, p))[1])
    runner = FakeRunner(256)
    ae = AsyncEngine(make_engine(runner, max_num_seqs=4))
    b = Backend(engine=ae, tokenizer=None, model_dir=".", model_name="m", device="cpu",
                max_model_len=1024, vocab_size=runner.vocab_size, kv_tokens=256 * 4, page_size=4)
    t = ServerThread(make_app(ServerState(ServerConfig(served_model_names=["m"]), b))).start()
    try:
        body = {"model": "m", "prompt": [[3, 1, 4, 1, 5], [9, 2, 6]], "max_tokens": 3,
                "temperature": 0, "ignore_eos": True}
        s, _, raw = request(t.port, "POST", "/v1/completions", body)
        assert s == 200 and len(json.loads(raw)["choices"]) == 2, raw
        assert sorted(calls) == [3, 5]                 # each prompt once, by app.serve
        s, _, raw = request(t.port, "POST", "/v1/completions", dict(body, prompt=[3, 500]))
        assert s == 400 and b"must be in" in raw, raw  # a bad id is still refused up front
    finally:
        t.stop()
        ae.shutdown()
