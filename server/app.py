"""The OpenAI-compatible HTTP layer: FastAPI routes over the engine handle (AsyncEngine).

    state = ServerState(ServerConfig(served_model_names=["smollm2"]))
    app = make_app(state)            # /health answers 503 until ...
    state.attach(load_backend(...))  # ... the backend is attached (a thread does this at startup)

It owns protocol only: parsing and checking requests (protocol.py), chat templates (chat.py),
turning engine outputs into OpenAI responses and SSE chunks (generation.py), errors in OpenAI's
shape, auth and limits (http.py's Guard; body size, n, queued requests), and aborting a request
whose client went away (http.py). This file is the routes; the configuration and the attached
backend are state.py's. What runs when, and where its KV lives, is the engine's business.

Streams are written by SSEResponse, which always races the generator against the client's
http.disconnect: a disconnect cancels the generator, and AsyncEngine.generate aborts the request
when its consumer is cancelled, so the KV is freed at the next step. Non-streaming requests get
the same race (`until_disconnect`).
"""
import json

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from infc.runtime.engine.async_engine import EngineDeadError

from . import metrics, protocol
from .generation import Generation, engine_error
from .http import ClientGone, Guard, SSEResponse, error_response, json_response, read_body, until_disconnect
from .protocol import APIError, bad
from .state import ServerConfig, ServerState

__all__ = ["ServerConfig", "ServerState", "make_app"]


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
            raise ClientGone() from None

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
            return json_response(await until_disconnect(request, g.collect()))
        except ClientGone:
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
        except ClientGone:
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
