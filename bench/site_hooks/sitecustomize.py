"""Hooks the benchmarks put into a spawned `infc serve` (this folder first on its PYTHONPATH),
each on only when its variable names a file; then the sitecustomize this one shadows, if any, runs
as it would have.

GIL_WATCH_OUT (`infc bench startup --gil-watch`): a thread that sleeps 1 ms at a time. A wake-up
more than 20 ms late means another thread held the GIL all along (a C call that never lets it go:
a Rust tokenizer's load, a large dict built in one call), which stalls every other thread, the
loading one too. Each stall is written as "<time.perf_counter() when it began> <seconds>" (the
clock is system-wide: the benchmark subtracts its spawn time). Nothing of infc is imported.

SERVER_TRACE_OUT (`infc bench prefix --path serve --trace-server`, bench/server_trace.py): marks
the moments a request passes through the server, as "<time> <mark>" lines appended every 0.2 s
(the same system-wide clock, so the benchmark lines them up with its own send and first-token
times). The marks, in a request's order:

    conn      the HTTP connection accepted (server/connection.py)
    asgi      the request reaches the app (Starlette)
    body      its body read (server/http.py read_body)
    pool>     on the worker pool (server/offload.py off_loop): parse, tokenize, check, admit
    send      handed to the engine thread (AsyncEngine._send), from the pool
    pool<     back on the event loop (beside the engine's work from here on)
    add       the engine adds it (Engine.add_request)
    step>     the engine's steps, each
    step<
    put       an output handed back to the event loop (AsyncEngine._put)
    chunk     an SSE chunk made (server/generation.py Generation.chunk)
"""
import importlib
import os
import sys
import threading
import time


def _watch(path: str, limit_s: float = 60.0):
    t0 = last = time.perf_counter()
    with open(path, "a", buffering=1) as f:
        while last - t0 < limit_s:
            time.sleep(0.001)
            now = time.perf_counter()
            if now - last > 0.02:
                f.write(f"{last:.4f} {now - last:.4f}\n")
            last = now


def _install(path: str):
    import functools                            # (here: the GIL watch times a start; it imports neither)
    import inspect
    marks: list = []
    clock = time.perf_counter

    def mark(name: str):
        marks.append((clock(), name))

    def flush():                                # only the marks since the last flush: a long run's
        done = 0                                # whole list, rewritten, held the GIL for milliseconds
        open(path, "w").close()
        while True:
            time.sleep(0.2)
            new = marks[done:len(marks)]
            done += len(new)
            with open(path, "a") as f:
                f.write("".join(f"{t:.6f} {n}\n" for t, n in new))

    def at_entry(owner, attr: str, name: str, leave: str | None = None):
        f = getattr(owner, attr)
        if hasattr(f, "__wrapped_by_trace__"):
            return
        if inspect.iscoroutinefunction(f):
            @functools.wraps(f)
            async def g(*a, **k):
                mark(name)
                try:
                    return await f(*a, **k)
                finally:
                    if leave:
                        mark(leave)
        else:
            @functools.wraps(f)
            def g(*a, **k):
                mark(name)
                try:
                    return f(*a, **k)
                finally:
                    if leave:
                        mark(leave)
        g.__wrapped_by_trace__ = True
        setattr(owner, attr, g)

    from infc.runtime.engine import async_engine, engine
    from infc.server import app, connection, generation, offload
    at_entry(connection.Guarded, "connection_made", "conn")
    at_entry(app, "read_body", "body")
    at_entry(async_engine.AsyncEngine, "_send", "send")
    at_entry(engine.Engine, "add_request", "add")
    at_entry(engine.Engine, "step", "step>", "step<")
    at_entry(async_engine.AsyncEngine, "_put", "put")
    at_entry(generation.Generation, "chunk", "chunk")
    def on_pool(fn):
        def run(*a, **k):
            mark("pool>")
            return fn(*a, **k)
        return run

    off, owned = offload.off_loop, offload.off_loop_owned

    async def off_loop(fn, *a, **k):
        try:
            return await off(on_pool(fn), *a, **k)
        finally:
            mark("pool<")

    async def off_loop_owned(fn, dropped):
        try:
            return await owned(on_pool(fn), dropped)
        finally:
            mark("pool<")
    app.off_loop, app.off_loop_owned = off_loop, off_loop_owned
    import starlette.applications as sa
    call = sa.Starlette.__call__

    async def asgi(self, scope, receive, send):
        if scope.get("type") == "http":
            mark("asgi")
        return await call(self, scope, receive, send)
    sa.Starlette.__call__ = asgi
    threading.Thread(target=flush, name="server-trace", daemon=True).start()


if os.environ.get("GIL_WATCH_OUT"):
    threading.Thread(target=_watch, args=(os.environ["GIL_WATCH_OUT"],), name="gil-watch", daemon=True).start()
if os.environ.get("SERVER_TRACE_OUT"):
    _install(os.environ["SERVER_TRACE_OUT"])

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
_me = sys.modules.pop("sitecustomize")
try:
    importlib.import_module("sitecustomize")
except ImportError:                            # none shadowed: the import system finds this one back
    sys.modules["sitecustomize"] = _me
