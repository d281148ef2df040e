"""server/connection.py under each HTTP parser (INFC_HTTP_PARSER: httptools, the default, and h11)
and event loop (INFC_EVENT_LOOP: uvloop, the default, and asyncio), on a bare route: a request is
served; headers still incomplete past max_header_bytes are a 400 and a closed connection (h11 bounds them itself, the httptools protocol by counting); headers or a
body that do not arrive in time are a 408 in the API's error shape."""
import asyncio
import json
import os
import socket

import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from infc.server import connection
from infc.server.serve import ServerThread


async def _echo(request):
    return JSONResponse({"n": len(await request.body())},
                        headers={"x-loop": type(asyncio.get_running_loop()).__module__.split(".")[0]})


APP = Starlette(routes=[Route("/echo", _echo, methods=["POST"])])


@pytest.fixture(params=[("httptools", "uvloop"), ("h11", "asyncio")])
def server(request, monkeypatch):
    parser, loop = request.param
    monkeypatch.setenv("INFC_HTTP_PARSER", parser)
    monkeypatch.setenv("INFC_EVENT_LOOP", loop)
    cls = connection.protocol_class()
    assert cls.__name__ == {"httptools": "GuardedHttpToolsProtocol", "h11": "GuardedH11Protocol"}[parser]
    assert connection.event_loop() == loop
    s = ServerThread(APP, max_header_bytes=4096, header_timeout=0.5, body_timeout=0.5).start()
    yield s
    s.stop()


def _exchange(port, chunks) -> bytes:
    """What the server sends back (until it closes, or 5 s of silence) for these chunks."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        for c in chunks:
            sock.sendall(c)
        got = b""
        try:
            while chunk := sock.recv(65536):
                got += chunk
                if b"connection: close" not in got.lower() and got.endswith(b"}"):
                    break                              # a kept-alive JSON reply is whole
        except TimeoutError:
            pass
    return got


def _post(body: bytes) -> bytes:
    return (b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + b"Content-Length: %d\r\n\r\n" % len(body) + body)


def test_a_request_is_served(server):
    got = _exchange(server.port, [_post(b'{"a": 1}')])
    assert got.startswith(b"HTTP/1.1 200") and got.endswith(b'{"n":8}')
    assert f"x-loop: {os.environ['INFC_EVENT_LOOP']}".encode() in got.lower()     # the loop named runs it


def test_headers_incomplete_past_the_bound_are_a_400(server):
    got = _exchange(server.port, [b"GET /echo HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 3000, b"a" * 3000])
    assert got.startswith(b"HTTP/1.1 400") and got.endswith(b"Invalid HTTP request received.")


def test_headers_that_stop_arriving_are_a_408(server):
    got = _exchange(server.port, [b"POST /echo HTTP/1.1\r\nHost: x\r\n"])
    assert got.startswith(b"HTTP/1.1 408")
    assert json.loads(got.partition(b"\r\n\r\n")[2])["error"]["code"] == "request_timeout"


def test_a_body_that_stops_arriving_is_a_408(server):
    whole = _post(b'{"a": "' + b"x" * 100 + b'"}')
    got = _exchange(server.port, [whole[:-20]])
    assert got.startswith(b"HTTP/1.1 408") and b"body" in got


def test_an_unknown_parser_or_loop_is_refused(monkeypatch):
    monkeypatch.setenv("INFC_HTTP_PARSER", "picohttp")
    with pytest.raises(ValueError, match="INFC_HTTP_PARSER='picohttp'"):
        connection.protocol_class()
    monkeypatch.setenv("INFC_HTTP_PARSER", "h11")
    monkeypatch.setenv("INFC_EVENT_LOOP", "trio")
    with pytest.raises(ValueError, match="INFC_EVENT_LOOP='trio'"):
        connection.event_loop()
