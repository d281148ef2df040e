"""`infc serve`'s shutdown (issue 39), as vLLM's and uvicorn's users expect it.

The first SIGTERM or SIGINT drains: the port stays open, but every new request (and /health) is
answered 503 with Retry-After and `Connection: close`, so a load balancer routes elsewhere; the
requests in flight run on for up to --shutdown-timeout seconds. Those still running then are
ended by shutting the engine down: each waiter gets EngineDeadError, which a stream renders as an
SSE error event then `data: [DONE]`, and a whole response as a 503. Then uvicorn stops and
`infc serve` exits 0. A second signal exits at once (status 1), with one line and no traceback.
Rank processes (rank_workers.py) exit when rank 0's sockets close, i.e. with this process.

DrainGuard is the ASGI wrapper that refuses and counts requests; GracefulServer is uvicorn's
Server with this signal handling (uvicorn's own closes the port at once, and re-raises the
signal after it stops: exit -15, or a KeyboardInterrupt traceback and 130).
"""
import os
import sys
import threading
import time

import uvicorn

from .args import SHUTDOWN_TIMEOUT_S
from .http import error_response
from .protocol import APIError

END_MARGIN_S = 5.0         # after the engine stops: for the ended requests' last bytes to leave
RETRY_AFTER_S = 5


class Lifecycle:
    """What DrainGuard and GracefulServer share: whether the server drains, and the requests
    being answered (refused ones not counted)."""

    def __init__(self, shutdown_timeout: float = SHUTDOWN_TIMEOUT_S):
        if shutdown_timeout < 0:
            raise ValueError(f"--shutdown-timeout must be >= 0, got {shutdown_timeout}")
        self.shutdown_timeout = shutdown_timeout
        self.draining = False
        self.active = 0                 # touched on the event loop only


class DrainGuard:
    """ASGI: while draining, answer every HTTP request but /metrics 503 (scrapers may watch the
    drain); otherwise pass it on, counted in Lifecycle.active until its response is done."""

    def __init__(self, app, life: Lifecycle):
        self.app, self.life = app, life

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.life.draining and scope.get("path") != "/metrics":
            refusal = error_response(APIError(503, "the server is shutting down", "server_error",
                                              code="shutting_down",
                                              headers={"Retry-After": str(RETRY_AFTER_S),
                                                       "Connection": "close"}))
            return await refusal(scope, receive, send)
        self.life.active += 1
        try:
            return await self.app(scope, receive, send)
        finally:
            self.life.active -= 1


class GracefulServer(uvicorn.Server):
    """uvicorn's Server, draining on the first SIGTERM / SIGINT (see above). stop_engine(): ends
    what the engine still runs (AsyncEngine.shutdown), None while there is no engine."""

    def __init__(self, config: uvicorn.Config, life: Lifecycle, stop_engine):
        super().__init__(config)
        self.life, self.stop_engine = life, stop_engine

    def handle_exit(self, sig, frame):
        # the signal's handler, on the main thread: never blocks; the signal is not re-raised
        # after the server stops (uvicorn's _captured_signals stays empty)
        if self.life.draining or self.should_exit:
            print(f"infc serve: a second signal: stopping now ({self.life.active} requests cut off)",
                  file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(1)
        self.life.draining = True
        threading.Thread(target=self._drain, name="infc-drain", daemon=True).start()

    def _drain(self):
        life = self.life
        if life.active:
            print(f"infc serve: shutting down: {life.active} requests in flight, up to "
                  f"{life.shutdown_timeout:g} s to finish (a second signal stops at once)",
                  file=sys.stderr, flush=True)
        deadline = time.monotonic() + life.shutdown_timeout
        while life.active and time.monotonic() < deadline:
            time.sleep(0.02)
        left = life.active
        if left:
            print(f"infc serve: ending {left} requests still running after {life.shutdown_timeout:g} s",
                  file=sys.stderr, flush=True)
        self.stop_engine()          # the rest get an error (event) at once; the engine is freed
        deadline = time.monotonic() + END_MARGIN_S
        while life.active and time.monotonic() < deadline:
            time.sleep(0.02)
        self.should_exit = True
