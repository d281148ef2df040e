"""HTTP plumbing under the routes: JSON and error responses, server-sent events raced against the
client's disconnect, the same race for non-streaming requests, the JSON Content-Type rule (415,
see app.py's docstring for why), bounded body reads, and the Guard middleware (header size cap
and API key)."""
import asyncio
import hashlib
import hmac
import json

from starlette.requests import Request
from starlette.responses import Response

from .protocol import APIError, bad

PROTECTED = ("/v1/", "/tokenize", "/detokenize", "/tokenizer_info")


# -- responses ----------------------------------------------------------------------------------
def dumps(obj) -> bytes:
    # ensure_ascii=False keeps text readable; "replace" guarantees valid UTF-8 on the wire.
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "replace")


def json_response(obj, status: int = 200, headers: dict | None = None) -> Response:
    return json_bytes_response(dumps(obj), status, headers)


def json_bytes_response(data: bytes, status: int = 200, headers: dict | None = None) -> Response:
    """A body dumps() made already (on the worker pool, when it grows with the request)."""
    return Response(data, status, headers=headers, media_type="application/json")


def error_response(e: APIError) -> Response:
    return json_response(e.body(), e.status, e.headers)


def sse(obj) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


class SSEResponse(Response):
    """text/event-stream from an async generator of bytes, cancelled when the client leaves."""

    def __init__(self, gen, on_close):
        super().__init__(status_code=200, media_type="text/event-stream")
        self.gen, self.on_close = gen, on_close

    async def __call__(self, scope, receive, send):
        headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                   (b"x-accel-buffering", b"no")]

        async def produce():
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            async for chunk in self.gen:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def watch():
            while (await receive())["type"] != "http.disconnect":
                pass

        producer, watcher = asyncio.create_task(produce()), asyncio.create_task(watch())
        try:
            await asyncio.wait({producer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            producer.cancel()
            watcher.cancel()
            await asyncio.gather(producer, watcher, return_exceptions=True)
            await self.gen.aclose()
            self.on_close()


class ClientGone(Exception):
    pass


async def until_disconnect(request: Request, coro):
    """Run coro; if the client disconnects first, cancel it (which aborts its engine requests)."""
    task = asyncio.create_task(coro)

    async def watch():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.create_task(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientGone()
    finally:
        for t in (task, watcher):
            t.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)


def is_json_type(content_type: str | None) -> bool:
    """application/json or application/<anything>+json, parameters (charset=...) allowed."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def require_json(request: Request):
    ct = request.headers.get("content-type")
    if not is_json_type(ct):
        got = "no Content-Type" if ct is None else f"Content-Type {ct[:80]!r}"
        raise APIError(415, f"this route takes a JSON body: send Content-Type: application/json (got {got})",
                       "invalid_request_error", None, "unsupported_media_type")


async def read_body(request: Request, limit: int) -> bytes:
    cl = request.headers.get("content-length")
    if cl is not None:
        if not cl.isdigit():
            raise bad("invalid Content-Length header")
        if int(cl) > limit:
            raise APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


class Guard:
    """Pure ASGI middleware: the header size cap, and the API key (constant-time, on hashes so
    that not even the key's length leaks). The connection bounds only a header block still
    incomplete past the cap (server/connection.py); one that arrives whole is measured here."""

    def __init__(self, app, state):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            size = (sum(len(k) + len(v) + 4 for k, v in scope.get("headers", []))
                    + len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b""))
            if size > self.state.config.max_header_bytes:
                e = APIError(431, f"the request headers are larger than {self.state.config.max_header_bytes} bytes",
                             code="request_header_fields_too_large")
                await error_response(e)(scope, receive, send)
                return
        key = self.state.config.api_key
        if scope["type"] == "http" and key and scope["path"].startswith(PROTECTED):
            given = b""
            for name, value in scope.get("headers", []):
                if name == b"authorization":
                    given = value
            token = given[7:] if given[:7].lower() == b"bearer " else b"\x00"
            ok = hmac.compare_digest(hashlib.sha256(token).digest(), hashlib.sha256(key.encode()).digest())
            if not ok:
                e = APIError(401, "invalid or missing API key (send Authorization: Bearer <key>)",
                             "invalid_request_error", None, "invalid_api_key")
                await error_response(e)(scope, receive, send)
                return
        await self.app(scope, receive, send)
