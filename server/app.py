"""The OpenAI-compatible HTTP layer: FastAPI routes over the engine handle (AsyncEngine).

    state = ServerState(ServerConfig(served_model_names=["smollm2"]))
    app = make_app(state)            # /health answers 503 until ...
    state.attach(load_backend(...))  # ... the backend is attached (a thread does this at startup)

It owns protocol only: parsing and checking requests (protocol.py), chat templates (chat.py),
turning engine outputs into OpenAI responses and SSE chunks, errors in OpenAI's shape, auth,
limits (body size, n, queued requests), and aborting a request whose client went away. What runs
when, and where its KV lives, is the engine's business.

Streams are written by SSEResponse, which always races the generator against the client's
http.disconnect: a disconnect cancels the generator, and AsyncEngine.generate aborts the request
when its consumer is cancelled, so the KV is freed at the next step. Non-streaming requests get
the same race (`_until_disconnect`).
"""
import asyncio
import hashlib
import hmac
import json
import time
import uuid
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from infc.runtime.async_engine import EngineDeadError

from . import chat, metrics, protocol, scoring
from .protocol import APIError, bad

PROTECTED = ("/v1/", "/tokenize", "/detokenize", "/tokenizer_info")


@dataclass
class ServerConfig:
    served_model_names: list = field(default_factory=lambda: ["model"])
    api_key: str | None = None
    max_num_seqs: int = 256
    max_queued_requests: int = 1024          # sequences waiting beyond max_num_seqs before 429
    max_logprobs: int = 20
    max_n: int = 128
    max_request_body_bytes: int = 16 << 20
    max_header_bytes: int = 16 << 10         # all request headers together; more is a 431
    chat_template: str | None = None         # overrides the model's
    trust_request_chat_template: bool = False
    root: str | None = None                  # shown as the model's root in /v1/models


class ServerState:
    def __init__(self, config: ServerConfig, backend=None):
        self.config = config
        self.backend = None
        self.error: BaseException | None = None     # the startup failure, if any
        self.inflight_seqs = 0                        # sequences of requests being served
        self.created = int(time.time())
        self.template, self.special, self.limits = None, {}, None
        self._token_str: dict[int, str] = {}
        if backend is not None:
            self.attach(backend)

    def attach(self, backend):
        c = self.config
        self.template = c.chat_template or chat.find_template(backend.tokenizer_config, backend.model_dir)
        self.special = chat.special_tokens(backend.tokenizer_config)
        self.limits = protocol.Limits(backend.max_model_len, backend.vocab_size, c.max_logprobs, c.max_n)
        self.backend = backend                        # last: from here on the server is ready

    @property
    def ready(self) -> bool:
        return self.backend is not None and self.backend.engine.healthy

    def token_str(self, t: int) -> str:
        s = self._token_str.get(t)
        if s is None:
            tok = self.backend.tokenizer
            s = tok.decode([t], skip_special_tokens=False) if tok is not None else f"token_id:{t}"
            if len(self._token_str) < 1 << 18:
                self._token_str[t] = s
        return s


# -- responses ----------------------------------------------------------------------------------
def dumps(obj) -> bytes:
    # ensure_ascii=False keeps text readable; "replace" guarantees valid UTF-8 on the wire.
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "replace")


def json_response(obj, status: int = 200, headers: dict | None = None) -> Response:
    return Response(dumps(obj), status, headers=headers, media_type="application/json")


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


class _ClientGone(Exception):
    pass


async def _until_disconnect(request: Request, coro):
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
        raise _ClientGone()
    finally:
        for t in (task, watcher):
            t.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)


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


# -- the engine's outputs -----------------------------------------------------------------------
async def merged(engine, jobs):
    """(job index, StepOutput) from several engine requests at once; cancelling the consumer
    cancels every request (each aborts in the engine)."""
    q: asyncio.Queue = asyncio.Queue()

    async def pump(k, ids, params, rid):
        try:
            async for out in engine.generate(ids, params, rid):
                q.put_nowait((k, out))
        except asyncio.CancelledError:
            raise
        except BaseException as e:   # noqa: BLE001 - handed to the consumer
            q.put_nowait((k, e))
            return
        q.put_nowait((k, None))

    tasks = [asyncio.create_task(pump(k, ids, params, rid)) for k, ids, params, rid in jobs]
    try:
        left = len(tasks)
        while left:
            k, item = await q.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield k, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def run_all(*coros):
    """Run coroutines together; the first failure cancels the rest and is raised as itself."""
    try:
        async with asyncio.TaskGroup() as tg:
            for c in coros:
                tg.create_task(c)
    except BaseExceptionGroup as eg:           # noqa: F821 - builtin in 3.11
        first = eg.exceptions[0]
        while isinstance(first, BaseExceptionGroup):  # noqa: F821
            first = first.exceptions[0]
        raise first from None


def engine_error(e: BaseException) -> APIError:
    if isinstance(e, EngineDeadError):
        return APIError(503, f"the engine is not running: {e}", "server_error", code="engine_dead",
                        headers={"Retry-After": "5"})
    if isinstance(e, ValueError):
        return bad(str(e))
    return APIError(500, f"internal error: {type(e).__name__}: {e}", "server_error")


@dataclass
class _Choice:
    text: str = ""
    token_ids: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class Generation:
    """One checked request on its way through the engine, and its OpenAI rendering."""

    def __init__(self, state: ServerState, req: protocol.GenRequest, model: str):
        self.state, self.req, self.model = state, req, model
        self.b = state.backend
        self.engine = self.b.engine
        self.chat = req.kind == "chat"
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.object = "chat.completion" if self.chat else "text_completion"
        self.prompt_logprobs: list = [None] * len(req.prompts)
        self.prompt_tokens = sum(len(p) for p in req.prompts)

    # engine requests
    def jobs(self):
        if self.req.params is None:
            return []
        return [(k, ids, self.req.params, f"{self.id}-{k}") for k, ids in enumerate(self.req.prompts)]

    def index(self, k: int, i: int) -> int:
        return k * self.req.n + i

    async def score_prompts(self):
        """Prompt logprobs for echo: entry 0 has no context, so no logprob."""
        if not (self.req.echo and self.req.logprobs is not None):
            return

        async def one(k, ids):
            lps = await scoring.prompt_logprobs(self.engine, ids, self.req.logprobs, self.b.vocab_size,
                                                f"{self.id}-{k}")
            lps[0] = {"token": ids[0], "logprob": None, "top": None}
            self.prompt_logprobs[k] = lps

        await run_all(*(one(k, ids) for k, ids in enumerate(self.req.prompts)))

    def echo_text(self, k: int) -> str:
        t = self.req.texts[k]
        if t is None:
            t = self.b.tokenizer.decode(self.req.prompts[k], skip_special_tokens=False)
        return t

    def usage(self, completion_tokens: int) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": self.prompt_tokens + completion_tokens}

    # logprobs, as the two endpoints spell them
    def completion_logprobs(self, entries: list, offset: int) -> tuple[dict, int]:
        tokens, lps, tops, offsets = [], [], [], []
        for e in entries:
            s = self.state.token_str(e["token"])
            tokens.append(s)
            lps.append(e["logprob"])
            if e["top"] is None:
                tops.append(None)
            else:
                d = {self.state.token_str(t): lp for t, lp in e["top"]}
                d.setdefault(s, e["logprob"])
                tops.append(d)
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}, offset

    def chat_logprobs(self, entries: list) -> dict:
        def item(t, lp):
            s = self.state.token_str(t)
            return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8", "replace"))}
        return {"content": [dict(item(e["token"], e["logprob"]),
                                 top_logprobs=[item(t, lp) for t, lp in (e["top"] or [])])
                            for e in entries]}

    # non-streaming
    async def collect(self) -> dict:
        choices = {(k, i): _Choice() for k in range(len(self.req.prompts)) for i in range(self.req.n)}

        async def gen():
            async for k, out in merged(self.engine, self.jobs()):
                c = choices[(k, out.index)]
                c.text += out.text
                c.token_ids += out.token_ids
                if out.logprobs:
                    c.logprobs += out.logprobs
                if out.finished:
                    c.finish_reason, c.stop_reason = out.finish_reason, out.stop_reason

        await run_all(gen(), self.score_prompts())
        out = []
        for (k, i), c in choices.items():
            idx = self.index(k, i)
            finish = c.finish_reason or "length"
            if self.chat:
                out.append({"index": idx, "message": {"role": "assistant", "content": c.text},
                            "logprobs": self.chat_logprobs(c.logprobs) if self.req.logprobs is not None else None,
                            "finish_reason": finish, "stop_reason": c.stop_reason})
                continue
            text, lp = c.text, None
            if self.req.echo:
                text = self.echo_text(k) + text
            if self.req.logprobs is not None:
                entries = (self.prompt_logprobs[k] or []) + c.logprobs
                lp, _ = self.completion_logprobs(entries, 0)
            out.append({"index": idx, "text": text, "logprobs": lp, "finish_reason": finish,
                        "stop_reason": c.stop_reason})
        out.sort(key=lambda c: c["index"])
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": out, "usage": self.usage(sum(len(c.token_ids) for c in choices.values()))}

    # streaming
    def chunk(self, choices: list, usage: dict | None = None) -> bytes:
        obj = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
               "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            obj["usage"] = usage
        return sse(obj)

    async def stream(self):
        req, done_tokens = self.req, 0
        offsets: dict[int, int] = {}
        try:
            live = self.usage(0) if req.continuous_usage else None
            if self.chat:
                yield self.chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                   "logprobs": None, "finish_reason": None} for i in range(req.n)], live)
            elif req.echo:
                await self.score_prompts()
                first = []
                for k in range(len(req.prompts)):
                    for i in range(req.n):
                        lp = None
                        if req.logprobs is not None:
                            lp, offsets[self.index(k, i)] = self.completion_logprobs(self.prompt_logprobs[k], 0)
                        first.append({"index": self.index(k, i), "text": self.echo_text(k), "logprobs": lp,
                                      "finish_reason": None if req.params else "length", "stop_reason": None})
                yield self.chunk(first, live)
            async for k, out in merged(self.engine, self.jobs()):
                idx = self.index(k, out.index)
                done_tokens += len(out.token_ids)
                if not (out.text or out.finished or (req.logprobs is not None and out.logprobs)):
                    continue
                if self.chat:
                    c = {"index": idx, "delta": {"content": out.text} if out.text else {},
                         "logprobs": self.chat_logprobs(out.logprobs or []) if req.logprobs is not None else None,
                         "finish_reason": out.finish_reason, "stop_reason": out.stop_reason}
                else:
                    lp = None
                    if req.logprobs is not None:
                        lp, offsets[idx] = self.completion_logprobs(out.logprobs or [], offsets.get(idx, 0))
                    c = {"index": idx, "text": out.text, "logprobs": lp, "finish_reason": out.finish_reason,
                         "stop_reason": out.stop_reason}
                yield self.chunk([c], self.usage(done_tokens) if req.continuous_usage else None)
            if req.include_usage:
                yield self.chunk([], self.usage(done_tokens))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a failure mid-stream is an error event, then [DONE]
            err = e if isinstance(e, APIError) else engine_error(e)
            yield sse(err.body())
        yield b"data: [DONE]\n\n"


# -- the app ------------------------------------------------------------------------------------
class Guard:
    """Pure ASGI middleware: the header size cap, and the API key (constant-time, on hashes so
    that not even the key's length leaks). h11 bounds only a header block that arrives in pieces;
    one that arrives whole is measured here."""

    def __init__(self, app, state: ServerState):
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


def make_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="infc", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.infc = state
    cfg = state.config

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e):
        return error_response(APIError(e.status_code, str(e.detail), "invalid_request_error"
                                       if e.status_code < 500 else "server_error", headers=e.headers))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, e):
        return error_response(bad(str(e)))

    @app.exception_handler(Exception)
    async def _internal(request, e):
        return error_response(APIError(500, f"internal error: {type(e).__name__}: {e}", "server_error"))

    def backend():
        if state.backend is None:
            raise APIError(503, "the model is still loading", "server_error", code="not_ready",
                           headers={"Retry-After": "5"})
        if not state.backend.engine.healthy:
            raise engine_error(EngineDeadError(f"the engine died: {state.backend.engine.error!r}"))
        return state.backend

    async def body_of(request: Request) -> dict:
        try:
            return protocol.parse_json(await read_body(request, cfg.max_request_body_bytes))
        except ClientDisconnect:
            raise _ClientGone() from None

    def model_of(body: dict) -> str:
        m = body.get("model")
        if m is None:
            return cfg.served_model_names[0]
        if not isinstance(m, str) or m not in cfg.served_model_names:
            shown = m if isinstance(m, str) else json.dumps(m)[:60]
            raise APIError(404, f"The model `{shown}` does not exist.", "invalid_request_error", "model",
                           "model_not_found")
        return m

    def admit(seqs: int):
        limit = cfg.max_num_seqs + cfg.max_queued_requests
        if state.inflight_seqs + seqs > limit:
            raise APIError(429, f"the server is at capacity ({state.inflight_seqs} sequences running or "
                                f"queued, at most {limit}): retry later", "requests", code="rate_limit_exceeded",
                           headers={"Retry-After": "1"})
        state.inflight_seqs += seqs

    async def serve(request: Request, req: protocol.GenRequest, model: str):
        b = state.backend
        if req.params is not None:
            for ids in req.prompts:                 # the engine's own rules, checked before any reply
                try:
                    b.engine.engine.check_request(ids, req.params)
                except ValueError as e:
                    raise bad(str(e)) from None
        seqs = len(req.prompts) * req.n
        admit(seqs)
        released = False

        def release():
            nonlocal released
            if not released:
                released = True
                state.inflight_seqs -= seqs

        g = Generation(state, req, model)
        if req.stream:
            return SSEResponse(g.stream(), release)
        try:
            return json_response(await _until_disconnect(request, g.collect()))
        except _ClientGone:
            return Response(status_code=499)
        except APIError:
            raise
        except Exception as e:  # noqa: BLE001
            raise engine_error(e) from None
        finally:
            release()

    async def guarded(request: Request, handler):
        try:
            return await handler()
        except _ClientGone:
            return Response(status_code=499)

    @app.post("/v1/completions")
    async def completions(request: Request):
        async def go():
            b = backend()
            body = await body_of(request)
            model = model_of(body)
            req = protocol.parse_completion(body, state.limits, b.tokenizer)
            return await serve(request, req, model)
        return await guarded(request, go)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        async def go():
            b = backend()
            body = await body_of(request)
            model = model_of(body)
            req = protocol.parse_chat(body, state.limits, b.tokenizer, state.template, state.special,
                                      cfg.trust_request_chat_template)
            return await serve(request, req, model)
        return await guarded(request, go)

    def model_card(name: str) -> dict:
        b = state.backend
        return {"id": name, "object": "model", "created": state.created, "owned_by": "infc",
                "root": cfg.root or (str(b.model_dir) if b else name), "parent": None,
                "max_model_len": b.max_model_len if b else None}

    @app.get("/v1/models")
    async def models():
        backend()
        return json_response({"object": "list", "data": [model_card(n) for n in cfg.served_model_names]})

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        backend()
        if name not in cfg.served_model_names:
            raise APIError(404, f"The model `{name}` does not exist.", "invalid_request_error", "model",
                           "model_not_found")
        return json_response(model_card(name))

    @app.get("/health")
    async def health():
        if state.ready:
            return Response(status_code=200)
        if state.backend is None:
            return error_response(APIError(503, "the model is still loading", "server_error", code="not_ready",
                                           headers={"Retry-After": "5"}))
        return error_response(engine_error(EngineDeadError(f"the engine died: {state.backend.engine.error!r}")))

    @app.get("/version")
    async def version():
        return json_response({"version": _version()})

    @app.get("/metrics")
    async def metrics_():
        stats = state.backend.engine.stats() if state.backend is not None else {}
        return Response(metrics.render(stats, cfg.served_model_names[0]).encode(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    def tokenizer_or_400(b):
        if b.tokenizer is None:
            raise bad("this model has no tokenizer")
        return b.tokenizer

    @app.post("/tokenize")
    async def tokenize(request: Request):
        async def go():
            b = backend()
            body = await body_of(request)
            model_of(body)
            tok = tokenizer_or_400(b)
            f = protocol.Fields(body)
            if "messages" in body:
                text = protocol.render_chat(body, state.template, tok, state.special,
                                            cfg.trust_request_chat_template)
                special = f.bool("add_special_tokens", False)
            else:
                text = f.str("prompt")
                if text is None:
                    raise bad("'prompt' (a string) or 'messages' is required", "prompt")
                special = f.bool("add_special_tokens", True)
            try:
                ids = tok.encode(text) if special else tok.encode_text(text)
            except Exception as e:  # noqa: BLE001
                raise bad(f"cannot tokenize: {e}") from None
            out = {"count": len(ids), "max_model_len": b.max_model_len, "tokens": ids, "token_strs": None}
            if f.bool("return_token_strs"):
                out["token_strs"] = [state.token_str(t) for t in ids]
            return json_response(out)
        return await guarded(request, go)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        async def go():
            b = backend()
            body = await body_of(request)
            model_of(body)
            tok = tokenizer_or_400(b)
            ids = protocol._token_ids(body.get("tokens"), "tokens", b.vocab_size, 1 << 20)
            return json_response({"prompt": tok.decode(ids, skip_special_tokens=False)})
        return await guarded(request, go)

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        b = backend()
        tok = tokenizer_or_400(b)
        info = {k: v for k, v in b.tokenizer_config.items() if k != "added_tokens_decoder"}
        info.update(state.special)
        info.update(tokenizer_class=b.tokenizer_config.get("tokenizer_class", "PreTrainedTokenizerFast"),
                    model_max_length=b.max_model_len, vocab_size=tok.vocab_size,
                    chat_template=state.template, add_bos_token=tok.add_bos)
        return json_response(info)

    return Guard(app, state)


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("infc")
    except Exception:  # noqa: BLE001
        return "unknown"
