"""`infc serve`: the command line (vLLM's flag spellings and defaults) and the uvicorn server.

A thread builds the backend from the first moment; this one imports the HTTP layer and opens the
port once the backend's device work (or a build) has begun; /health answers 503 until the backend
is attached, 200 once the engine is ready (each phase printed with its time as it finishes;
docs/serving.md, "Start"). Unknown flags are errors (argparse, with abbreviations off). Each accepted connection gets TCP_NODELAY, so an SSE
event leaves when it is written rather than after the peer's delayed ACK (asyncio sets it too;
this states it where it matters). Headers over --max-header-bytes are answered 431 (or 400 when
they are still incomplete past it: connection.py); a request whose headers or body do not arrive
within --request-header-timeout / --request-body-timeout seconds is answered 408 and its
connection closed (connection.py).

SIGTERM or SIGINT drains: new requests get 503 while those in flight finish, for up to
--shutdown-timeout seconds; the rest then end with an error, and the process exits 0. A second
signal exits at once (lifecycle.py).

If the engine dies (a step raised; a rank process died, seen at once even while idle), /health
answers 503 with the cause, requests get 503, and after DEAD_GRACE_S the server stops and the
process exits with status 1 and one line saying why, as vLLM's API server does when its engine
core is gone: a supervisor restarts it rather than routing to a server that can only fail.
"""
import functools
import os
import sys
import threading
import time

from .args import BODY_TIMEOUT_S, HEADER_TIMEOUT_S, backend_kwargs, config_from_args

DEAD_GRACE_S = 2.0       # /health and in-flight requests see the 503 before the port closes


def uvicorn_config(app, host="127.0.0.1", port=8000, log_level="info", access_log=True,
                   max_header_bytes=16 << 10, header_timeout=HEADER_TIMEOUT_S,
                   body_timeout=BODY_TIMEOUT_S):
    import uvicorn
    from .connection import event_loop, protocol_class
    from .lifecycle import END_MARGIN_S
    http = functools.partial(protocol_class(), header_timeout=header_timeout, body_timeout=body_timeout,
                             max_header_bytes=max_header_bytes)
    return uvicorn.Config(app, host=host, port=port, http=http, loop=event_loop(), lifespan="off",
                          log_level=log_level, access_log=access_log,
                          h11_max_incomplete_event_size=max_header_bytes, timeout_keep_alive=5,
                          timeout_graceful_shutdown=END_MARGIN_S)


class ServerThread:
    """uvicorn in a background thread (tests, benchmarks): start() returns once it listens."""

    def __init__(self, app, host="127.0.0.1", port=0, log_level="warning", **kw):
        import uvicorn
        self.server = uvicorn.Server(uvicorn_config(app, host, port, log_level, access_log=False, **kw))
        self.thread = threading.Thread(target=self.server.run, name="infc-http", daemon=True)
        self.host = host

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self.thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() - t0 > timeout:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout: float = 10.0):
        self.server.should_exit = True
        self.thread.join(timeout)


def process_age() -> float | None:
    """Seconds since this process started (the kernel's clock ticks, 10 ms), None off Linux."""
    try:
        start = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])
        uptime = float(open("/proc/uptime").read().split()[0])
        return max(uptime - start / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError):
        return None


def serve_main(args):
    """The backend loads on a thread from the first moment; the HTTP layer's imports and the
    port's opening wait until its device work begins (its reads and driver calls release the
    GIL); /health says 503 until it is attached. Each start phase prints one timed line."""
    config = config_from_args(args)
    out_lock = threading.Lock()

    def log(line: str):                   # whole lines: the loading thread prints beside this one
        with out_lock:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()
    age = process_age()
    if age is not None:
        log(f"  {'python start, infc imports':<32} {age:8.2f} s")
    holder: dict = {}

    def load():
        from infc.backend import load_backend
        from infc.runtime.engine.gc_freeze import freeze_startup
        try:
            backend = load_backend(args.model_path, log=log, on_device_work=device_work.set,
                                   **backend_kwargs(args))
            freeze_startup()              # the steps' collections then skip what loading made
            holder["backend"] = backend
        except BaseException as e:  # noqa: BLE001 - reported by serve_main after the server stops
            holder["error"] = e
        device_work.set()
        ready.set()

    ready, device_work = threading.Event(), threading.Event()
    threading.Thread(target=load, name="infc-load", daemon=True).start()
    # The HTTP layer's imports are Python too: beside the load's own Python they only take turns
    # with it under the GIL, beside its reads and driver calls they cost it ~nothing.
    device_work.wait()
    t0 = time.perf_counter()
    from .app import ServerState, make_app
    from .lifecycle import DrainGuard, GracefulServer, Lifecycle
    if args.host not in ("127.0.0.1", "localhost", "::1") and config.api_key is None:
        print(f"warning: listening on {args.host} without an API key", file=sys.stderr)
    state = ServerState(config)
    life = Lifecycle(args.shutdown_timeout)

    def stop_engine():
        if state.backend is not None:
            state.backend.engine.shutdown()

    app = DrainGuard(make_app(state), life)
    server = GracefulServer(uvicorn_config(app, args.host, args.port, args.uvicorn_log_level,
                                           not args.disable_uvicorn_access_log, args.max_header_bytes,
                                           args.request_header_timeout, args.request_body_timeout),
                            life, stop_engine)
    log(f"  {'HTTP layer imports (beside)':<32} {time.perf_counter() - t0:8.2f} s")

    def attach():
        ready.wait()
        while not server.started and not server.should_exit:
            time.sleep(0.005)             # the "serving" line names the port it opened
        if "error" in holder:
            state.error = holder["error"]
            server.should_exit = True
            return
        try:
            t1 = time.perf_counter()
            state.attach(holder["backend"])
            log(f"  {'attach to the server':<32} {time.perf_counter() - t1:8.2f} s")
            names = ", ".join(config.served_model_names)
            log(f"serving {names} at http://{args.host}:{server.servers[0].sockets[0].getsockname()[1]}")
        except BaseException as e:  # noqa: BLE001
            state.error = e
            server.should_exit = True

    died: list[BaseException] = []

    def watch():
        while not server.should_exit:
            b = state.backend
            if b is not None and not b.engine.healthy:
                died.append(b.engine.error)
                print(f"infc serve: the engine died ({b.engine.error}); stopping in "
                      f"{DEAD_GRACE_S:.0f} s", file=sys.stderr, flush=True)
                time.sleep(DEAD_GRACE_S)
                server.should_exit = True
                return
            time.sleep(0.1)

    threading.Thread(target=attach, name="infc-attach", daemon=True).start()
    threading.Thread(target=watch, name="infc-watch", daemon=True).start()
    try:
        server.run()
    finally:
        if state.backend is not None:
            state.backend.engine.shutdown()
        elif "backend" in holder:         # loaded while the server was stopping: never attached
            holder["backend"].engine.shutdown()
    if state.error is not None:
        raise state.error
    if died:
        print(f"error: infc serve exits: the engine died: {died[0]}", file=sys.stderr, flush=True)
        raise SystemExit(1)
