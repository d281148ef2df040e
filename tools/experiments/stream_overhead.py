"""Issue 49, item 5: the server's time a streamed token, and a warm prefix hit's, on the CPU, with
the engine out of the way.

`infc serve`'s HTTP layer (Starlette over the AsyncEngine, in a thread) in front of an Engine over
a runner that computes nothing (a constant token a row, bench/tier_host.py's), Qwen's tokenizer
for the detokenization: CONCURRENCY streaming /v1/completions requests of TOKENS tokens each from
an asyncio client in another process, timed as a whole. What it measures is the host's Python a
token (the engine's step bookkeeping, the hand-back to the loop, the SSE chunk, the socket) and
how that grows with the batch, not any model.

    python tools/experiments/stream_overhead.py TOKENIZER_DIR [--concurrency 1,16,64] [--tokens 128]

--hit L[,L...]: instead, `bench prefix`'s warm requests (an L-token text prefix sent once, then
prefix + 16 fresh one-token words, one token asked, streamed, a connection each) with the server's
marks (bench/server_trace.py), median ms after the send. The runner's step can stand in for a GPU
step's host side: --step-py-ms of Python holding the GIL (the eager launches), then --step-wait-ms
with it released (the wait for the GPU).
"""
import argparse
import asyncio
import json
import multiprocessing as mp
import time
from pathlib import Path


def _server(tok_dir: str, max_num_seqs: int, ready, port_out, stop, step_py_ms: float = 0.0,
            step_wait_ms: float = 0.0):
    from infc.backend import Backend
    from infc.config import DEFAULT_PAGE_SIZE
    from infc.bench.tier_host import _runner
    from infc.runtime.engine.async_engine import AsyncEngine
    from infc.runtime.engine.engine import Engine
    from infc.runtime.tokenization.tokenizer import Tokenizer
    from infc.server.app import make_app
    from infc.server.serve import ServerThread
    from infc.server.state import ServerConfig, ServerState
    tok = Tokenizer(Path(tok_dir))
    runner = _runner(1 << 15, DEFAULT_PAGE_SIZE)
    runner.vocab_size = tok.vocab_size
    if step_py_ms or step_wait_ms:
        execute = runner.execute

        def step(meta, sampling):
            end = time.perf_counter() + step_py_ms / 1e3
            while time.perf_counter() < end:       # Python: the GIL held, as by eager launches
                pass
            time.sleep(step_wait_ms / 1e3)         # released, as by the wait for the GPU
            return execute(meta, sampling)
        runner.execute = step
    engine = AsyncEngine(Engine(runner, tok, set(), 1 << 15, max_num_seqs=max_num_seqs))
    b = Backend(engine, tok, Path(tok_dir), "null", "cpu", 1 << 15, tok.vocab_size, 1 << 19, DEFAULT_PAGE_SIZE,
                set(), tok.config)
    srv = ServerThread(make_app(ServerState(ServerConfig(served_model_names=["m"], max_num_seqs=max_num_seqs), b))).start()
    port_out.value = srv.port
    ready.set()
    stop.wait()
    srv.stop()
    engine.shutdown()


async def _client(port: int, concurrency: int, tokens: int) -> dict:
    from infc.bench.serve import one_request
    url = f"http://127.0.0.1:{port}/v1/completions"
    body = {"model": "m", "prompt": "hello " * 32, "max_tokens": tokens, "stream": True,
            "ignore_eos": True, "temperature": 0}
    await one_request(url, body, {}, 60)                       # warm
    t0 = time.perf_counter()
    res = await asyncio.gather(*(one_request(url, body, {}, 120) for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    ok = [r for r in res if r["ok"]]
    n = sum(r["output_tokens"] for r in ok)
    return {"concurrency": concurrency, "ok": len(ok), "tokens": n, "wall_s": wall,
            "us_per_token": wall / n * 1e6, "tok_s": n / wall}


def _hits(port: int, tok_dir: str, lengths: list[int], reps: int, trace: str) -> list[dict]:
    import numpy as np
    from infc.bench.prefix import TextPrompts, _stream_ttft
    from infc.bench.server_trace import breakdown, describe, read_marks
    from infc.runtime.tokenization.tokenizer import Tokenizer
    prompts = TextPrompts(Tokenizer(Path(tok_dir)), np.random.default_rng(0))
    url = f"http://127.0.0.1:{port}/v1/completions"

    def send(prompt, span=None):
        body = {"model": "m", "prompt": prompt, "max_tokens": 1, "temperature": 0.0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        return _stream_ttft(url, body, 60, span)[0] * 1e3

    send(prompts.make(32))
    out = []
    for L in lengths:
        prefix = prompts.make(L)
        send(prefix)
        send(prefix + prompts.make(16, start=False))            # untimed, as bench prefix
        spans = []
        ttft = [send(prefix + prompts.make(16, start=False), spans) for _ in range(reps)]
        time.sleep(0.5)                                          # the marks reach the file every 0.2 s
        b = breakdown(read_marks(trace), spans)
        print(f"L={L}: ttft p50 {np.median(ttft):.3f} ms; {describe(b)}", flush=True)
        out.append({"L": L, "reps": reps, "p50_ms": float(np.median(ttft)), "p90_ms": float(np.percentile(ttft, 90)),
                    "trace_ms": b})
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tokenizer_dir")
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--hit", default=None, help="prefix lengths: time warm hits instead (see above)")
    ap.add_argument("--step-py-ms", type=float, default=0.0)
    ap.add_argument("--step-wait-ms", type=float, default=0.0)
    a = ap.parse_args(argv)
    levels = [int(x) for x in a.concurrency.split(",")]
    ctx = mp.get_context("spawn")
    ready, stop, port = ctx.Event(), ctx.Event(), ctx.Value("i", 0)
    trace = None
    if a.hit:
        import os
        import tempfile
        from infc.bench.server_trace import server_env
        fd, trace = tempfile.mkstemp(suffix=".marks")
        os.close(fd)
        os.environ.update(server_env(dict(os.environ), trace))  # the spawned server's site hooks
    p = ctx.Process(target=_server, args=(a.tokenizer_dir, max(levels), ready, port, stop, a.step_py_ms,
                                          a.step_wait_ms), daemon=True)
    p.start()
    ready.wait(120)
    try:
        if a.hit:
            for r in _hits(port.value, a.tokenizer_dir, [int(x) for x in a.hit.split(",")], a.reps, trace):
                print(json.dumps(r), flush=True)
            return
        for c in levels:
            rs = [asyncio.run(_client(port.value, c, a.tokens)) for _ in range(a.reps)]
            best = min(rs, key=lambda r: r["us_per_token"])
            print(json.dumps({**best, "us_per_token_all": [round(r["us_per_token"], 1) for r in rs]}), flush=True)
    finally:
        stop.set()
        p.join(30)
        if trace:
            Path(trace).unlink(missing_ok=True)


if __name__ == "__main__":
    main()
