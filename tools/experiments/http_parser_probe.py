"""A small POST's round trip through uvicorn and a bare Starlette route, per HTTP parser and event
loop: what server/connection.py's choice of parser (INFC_HTTP_PARSER) is worth before any of the
server's own work. One kept-alive connection, TCP_NODELAY, 3,000 requests, the first 500 dropped.

    .venv/bin/python tools/experiments/http_parser_probe.py     # h11 / httptools x asyncio / uvloop
"""
import json
import socket
import sys
import threading
import time


def one(http: str, loop: str, port: int, n: int = 3000) -> tuple[float, float]:
    """(p50, p10) microseconds of a request's round trip."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def echo(request):
        return JSONResponse({"n": len(await request.body())})

    app = Starlette(routes=[Route("/v1/completions", echo, methods=["POST"])])
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, http=http, loop=loop, lifespan="off",
                                        log_level="warning", access_log=False))
    threading.Thread(target=srv.run, daemon=True).start()
    t0 = time.monotonic()
    while not srv.started:
        if time.monotonic() - t0 > 10:
            raise RuntimeError(f"{http} / {loop}: the server did not start")
        time.sleep(0.01)
    body = json.dumps({"model": "m", "prompt": "hello " * 200, "max_tokens": 16, "stream": True}).encode()
    req = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" \
          b"Content-Length: %d\r\n\r\n" % len(body) + body
    ts = []
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(n):
            t = time.perf_counter()
            s.sendall(req)
            got = b""
            while not got.endswith(b"}"):
                got += s.recv(65536)
            ts.append(time.perf_counter() - t)
    srv.should_exit = True
    ts = sorted(ts[500:])
    return ts[len(ts) // 2] * 1e6, ts[len(ts) // 10] * 1e6


if __name__ == "__main__":
    import subprocess
    if len(sys.argv) == 4:                     # one configuration, in its own process
        p50, p10 = one(sys.argv[1], sys.argv[2], int(sys.argv[3]))
        print(f"{sys.argv[1]:9s} {sys.argv[2]:7s} p50 {p50:6.1f} us  p10 {p10:6.1f} us")
    else:
        for i, (http, loop) in enumerate([("h11", "asyncio"), ("httptools", "asyncio"), ("h11", "uvloop"),
                                          ("httptools", "uvloop")]):
            subprocess.run([sys.executable, __file__, http, loop, str(18300 + i)], check=False)
