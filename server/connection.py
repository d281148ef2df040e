"""One HTTP connection: uvicorn's protocol (httptools' C parser where it is installed, as uvicorn's
"standard" extra and vLLM's server run it; else h11's pure-Python one) with three things added:

- TCP_NODELAY on each accepted connection, so an SSE event leaves when it is written rather than
  after the peer's delayed ACK (asyncio sets it too; this states it where it matters);
- read timeouts (issue 39): a request whose headers are not complete within header_timeout
  seconds of its first byte (or of the connection opening), or whose body is not complete within
  body_timeout seconds of its headers (None or 0: no limit), is answered 408 (when no response has begun) and its
  connection closed. uvicorn times out only idle kept-alive connections (timeout_keep_alive),
  so a client that trickles a request, or sends half of one, would hold a connection forever;
- the headers' size: more than max_header_bytes of a request's headers still incomplete is
  answered 400 and the connection closed, as h11 does past its h11_max_incomplete_event_size
  (httptools buffers without a bound); complete headers over it reach the app, which answers
  431 (server/http.py).

Which parser: INFC_HTTP_PARSER; which event loop: INFC_EVENT_LOOP (uvloop, as vLLM's server runs,
else asyncio's; infc/envs.py). A small POST's round trip through a bare Starlette route on the
build machine (tools/experiments/http_parser_probe.py): h11 240-305 us, httptools 149-171, httptools
on uvloop 105-144 (bench/NOTES.md, session 2026-12-06 #9); each streamed event is framed by the
parser's side of the protocol too.
"""
import json
import logging
import socket

from uvicorn.protocols.http.h11_impl import H11Protocol

from .args import BODY_TIMEOUT_S, HEADER_TIMEOUT_S, http_env

log = logging.getLogger("uvicorn.error")


def _timeout_response(what: str, seconds: float) -> bytes:
    """The 408 written on the socket itself: the parser has no request to answer when headers
    time out. Its body is the API's error shape (protocol.APIError.body)."""
    body = json.dumps({"error": {"message": f"the request's {what} did not arrive within {seconds:g} s",
                                 "type": "invalid_request_error", "param": None,
                                 "code": "request_timeout"}}).encode()
    return (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


class Guarded:
    """The additions above, over either uvicorn protocol (they share connection_made,
    data_received, connection_lost, `cycle` with more_body / response_started /
    response_complete, `loop`, `transport` and send_400_response)."""
    bounds_headers = True                    # h11 bounds them itself (h11_max_incomplete_event_size)

    def __init__(self, *args, header_timeout: float | None = HEADER_TIMEOUT_S,
                 body_timeout: float | None = BODY_TIMEOUT_S, max_header_bytes: int | None = None, **kw):
        super().__init__(*args, **kw)
        self.header_timeout, self.body_timeout = header_timeout, body_timeout
        self.max_header_bytes = max_header_bytes
        self._timer = None
        self._reading: str | None = None       # "headers" | "body": what the timer waits for
        self._header_bytes = 0                 # bytes received since this request's headers began

    def connection_made(self, transport):
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
        super().connection_made(transport)
        self._expect("headers")

    def data_received(self, data: bytes):
        if self._reading is None and (self.cycle is None or self.cycle.response_complete):
            self._expect("headers")             # a new request begins on a kept-alive connection
        if self._reading == "headers":
            self._header_bytes += len(data)
        before = self.cycle
        super().data_received(data)
        if self.transport.is_closing():
            return                              # the parser refused the request (its 400 is sent)
        c = self.cycle
        if self._reading == "headers" and c is not None and c is not before:
            self._expect("body" if c.more_body else None)     # its headers are in
        elif self._reading == "body" and (c is None or not c.more_body):
            self._expect(None)                                 # its body is in
        elif self._reading == "headers" and self.bounds_headers and self.max_header_bytes \
                and self._header_bytes > self.max_header_bytes:
            self._expect(None)                  # headers past the bound and still not complete
            self.send_400_response("Invalid HTTP request received.")

    def connection_lost(self, exc):
        self._expect(None)
        super().connection_lost(exc)

    def _expect(self, what: str | None):
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._reading = None, what
        if what == "headers":
            self._header_bytes = 0
        seconds = {"headers": self.header_timeout, "body": self.body_timeout}.get(what)
        if seconds:
            self._timer = self.loop.call_later(seconds, self._timed_out, what, seconds)

    def _timed_out(self, what: str, seconds: float):
        self._timer, self._reading = None, None
        if self.transport.is_closing():
            return
        c = self.cycle
        if c is not None and not c.response_complete and c.response_started:
            self.transport.close()              # a response is under way: cut it
            return
        log.warning("%s: the request's %s did not arrive within %g s: closing the connection",
                    "%s:%d" % tuple(self.client[:2]) if self.client else "a client", what, seconds)
        self.transport.write(_timeout_response(what, seconds))
        self.transport.close()


class GuardedH11Protocol(Guarded, H11Protocol):
    bounds_headers = False


try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:                      # httptools not installed: uvicorn's own fallback is h11
    GuardedHttpToolsProtocol = None
else:
    class GuardedHttpToolsProtocol(Guarded, HttpToolsProtocol):
        pass


def protocol_class():
    """The connection class INFC_HTTP_PARSER names: "httptools" (the default; h11 where
    httptools is not installed) or "h11"."""
    if http_env()[0] == "httptools" and GuardedHttpToolsProtocol is not None:
        return GuardedHttpToolsProtocol
    return GuardedH11Protocol


def event_loop() -> str:
    """uvicorn's loop setting for INFC_EVENT_LOOP: "uvloop" (the default; asyncio's where uvloop is
    not installed) or "asyncio". Named, not uvicorn's "auto", so a machine's installed packages do
    not pick it silently."""
    want = http_env()[1]
    if want == "uvloop":
        try:
            import uvloop  # noqa: F401
        except ImportError:
            return "asyncio"
    return want
