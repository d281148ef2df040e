"""Issue 49, item 5: the server's time a streamed token, on the CPU, with the engine out of the way.

`infc serve`'s HTTP layer (Starlette over the AsyncEngine, in a thread) in front of an Engine over
a runner that computes nothing (a constant token a row, bench/tier_host.py's), Qwen's tokenizer
for the detokenization: CONCURRENCY streaming /v1/completions requests of TOKENS tokens each from
an asyncio client in another process, timed as a whole. What it measures is the host's Python a
token (the engine's step bookkeeping, the hand-back to the loop, the SSE chunk, the socket) and
how that grows with the batch, not any model.

    python tools/experiments/stream_overhead.py TOKENIZER_DIR [--concurrency 1,16,64] [--tokens 128]
"""
import argparse
import asyncio
import json
import multiprocessing as mp
import time
from pathlib import Path


def _server(tok_dir: str, max_num_seqs: int, ready, port_out, stop):
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
    engine = AsyncEngine(Engine(runner, tok, set(), 4096, max_num_seqs=max_num_seqs))
    b = Backend(engine, tok, Path(tok_dir), "null", "cpu", 4096, tok.vocab_size, 1 << 19, DEFAULT_PAGE_SIZE,
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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tokenizer_dir")
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args(argv)
    levels = [int(x) for x in a.concurrency.split(",")]
    ctx = mp.get_context("spawn")
    ready, stop, port = ctx.Event(), ctx.Event(), ctx.Value("i", 0)
    p = ctx.Process(target=_server, args=(a.tokenizer_dir, max(levels), ready, port, stop), daemon=True)
    p.start()
    ready.wait(120)
    try:
        for c in levels:
            rs = [asyncio.run(_client(port.value, c, a.tokens)) for _ in range(a.reps)]
            best = min(rs, key=lambda r: r["us_per_token"])
            print(json.dumps({**best, "us_per_token_all": [round(r["us_per_token"], 1) for r in rs]}), flush=True)
    finally:
        stop.set()
        p.join(30)


if __name__ == "__main__":
    main()
