"""The OpenAI-compatible HTTP layer: Starlette routes over the engine handle (AsyncEngine).

    state = ServerState(ServerConfig(served_model_names=["smollm2"]))
    app = make_app(state)            # /health answers 503 until ...
    state.attach(load_backend(...))  # ... the backend is attached (a thread does this at startup)

It owns protocol only: parsing and checking requests (protocol.py), chat templates (chat.py),
turning engine outputs into OpenAI responses and SSE chunks (generation.py), errors in OpenAI's
shape, auth and limits (http.py's Guard; body size, n, queued requests), and aborting a request
whose client went away (http.py). This file is the routes; the configuration and the attached
backend are state.py's. What runs when, and where its KV lives, is the engine's business.

The event loop only routes (docs/architecture.md, contract 17): a JSON route reads its bounded body on the
loop, then parses it, templates, tokenizes and checks every id and the engine's rules on the
worker pool (offload.py; the cheap bounds in protocol.py refuse what can never fit before
anything is tokenized), admits it by cost (admission.py) and queues it to the engine in the same
hop (AsyncEngine.open: the step starts while the loop sets up the reply), and the loop relays the
engine's outputs. A request with a grammar is admitted and queued by the loop, once compiled.
/tokenize and /detokenize run on the same pool; like vLLM's, /tokenize is not bounded by the
context (only by the body cap): a long text costs a worker for a while, never the loop. The
server talks to the engine only through AsyncEngine's methods.

JSON routes take only JSON: a POST whose Content-Type is not application/json (parameters such
as charset allowed) or application/<something>+json is answered 415 in OpenAI's error shape,
before its body is read, and so is one without a Content-Type. The OpenAI SDKs and vLLM's clients
send application/json; a web page can send a cross-origin POST without a CORS preflight only as
text/plain, application/x-www-form-urlencoded, multipart/form-data, or with no type at all (a
Blob body), so refusing all of those keeps a page in a user's browser from generating text on a
server without an API key (the CSRF vector). `curl -d` sends a form type: add
-H 'Content-Type: application/json'.

What a client sees for a request the HTTP parser itself rejects, before any of this runs (a
malformed request line or header, a header block still incomplete past --max-header-bytes, an
invalid Content-Length: server/connection.py): uvicorn's plain `400 Bad Request`, Content-Type
text/plain, the body "Invalid HTTP request received.", and the connection closed; not OpenAI's
JSON shape, since no route (and no request id) exists yet. A header block that arrives whole is
measured by http.py's Guard and answered 431 in OpenAI's shape.

Streams are written by SSEResponse, which always races the generator against the client's
http.disconnect: a disconnect cancels the generator, and a queued engine request whose consumer
is cancelled or never came (the reply's close, Generation.close) is aborted, so the KV is freed at
the next step. Non-streaming requests get the same race (`until_disconnect`).
"""
import asyncio
import inspect
import json

from starlette.applications import Starlette
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from infc.runtime.engine.async_engine import EngineDeadError
from infc.runtime.engine.sampling import SamplingParams
from infc.runtime.engine.sequence import PromptIds
from infc.runtime.engine.structured.request import StructuredOutputError

from . import admission, metrics, outputs, protocol, responses, scoring, structured
from .generation import Generation, engine_error
from .http import (ClientGone, Guard, SSEResponse, dumps, error_response, json_bytes_response, json_response,
                   read_body, require_json, until_disconnect)
from .offload import off_loop, off_loop_owned
from .protocol import APIError, bad
from .state import ServerConfig, ServerState

__all__ = ["ServerConfig", "ServerState", "make_app"]


class _Routes:
    """app.get / app.post as decorators over Starlette's routes: a route answers only its own
    methods (no implicit HEAD for a GET), and a handler takes the request only if it names one,
    its path parameters by name."""

    def __init__(self):
        self.routes = []

    def _add(self, method: str, path: str):
        def deco(fn):
            params = list(inspect.signature(fn).parameters)

            async def endpoint(request: Request):
                kw = {n: request if n == "request" else request.path_params[n] for n in params}
                return await fn(**kw)
            route = Route(path, endpoint, methods=[method])
            route.methods.discard("HEAD")
            self.routes.append(route)
            return fn
        return deco

    def get(self, path: str):
        return self._add("GET", path)

    def post(self, path: str):
        return self._add("POST", path)


def make_app(state: ServerState) -> Starlette:
    cfg = state.config
    app = _Routes()

    async def _api_error(request, e: APIError):
        return error_response(e)

    async def _http_error(request, e):
        return error_response(APIError(e.status_code, str(e.detail), "invalid_request_error"
                                       if e.status_code < 500 else "server_error", headers=e.headers))

    async def _internal(request, e):
        return error_response(APIError(500, f"internal error: {type(e).__name__}: {e}", "server_error"))

    def backend():
        if state.backend is None:
            raise APIError(503, "the model is still loading", "server_error", code="not_ready",
                           headers={"Retry-After": "5"})
        if not state.backend.engine.healthy:
            raise engine_error(EngineDeadError(f"the engine died: {state.backend.engine.error!r}"))
        return state.backend

    async def body_of(request: Request) -> bytes:
        """The raw body of a JSON route (parsed on the worker pool, with the rest)."""
        require_json(request)
        try:
            return await read_body(request, cfg.max_request_body_bytes)
        except ClientDisconnect:
            raise ClientGone() from None

    def loras() -> list[str]:
        b = state.backend
        return b.engine.lora_names() if b is not None and hasattr(b.engine, "lora_names") else []

    def model_of(body: dict) -> str:
        """The model a request names: a served name, or a loaded LoRA adapter's (vLLM's way of
        picking an adapter: `model: <adapter name>`)."""
        m = body.get("model")
        if m is None:
            return cfg.served_model_names[0]
        if not isinstance(m, str) or m not in cfg.served_model_names and m not in loras():
            shown = m if isinstance(m, str) else json.dumps(m)[:60]
            raise APIError(404, f"The model `{shown}` does not exist.", "invalid_request_error", "model",
                           "model_not_found")
        return m

    def engine_check(b, req: protocol.GenRequest):
        """The engine's own rules for every prompt, before any reply (echo alone: its scoring asks
        one token after the prompt, or after each prefix of it)."""
        params = scoring.engine_params(b.engine, req) or SamplingParams(max_tokens=1)
        for k, ids in enumerate(req.prompts):
            try:
                checked = b.engine.check_request(ids, params)
            except StructuredOutputError as e:
                raise structured.refusal(e, params.structured_outputs) from None
            except ValueError as e:
                raise bad(str(e)) from None
            # the ids are ints (the tokenizer's, or the protocol's checked JSON): the array the
            # check made goes with them, so the engine thread does not convert them again
            req.prompts[k] = PromptIds(ids, checked)

    async def checked(request: Request, parse):
        """(GenRequest, model, started): the body read here, everything that grows with it on
        the pool. A request without a grammar to compile is admitted and queued to the engine
        there too, once checked (started: its Generation and finish), so its first
        step runs while the loop sets up the reply; others are started by serve."""
        b = backend()
        raw = await body_of(request)
        loop = asyncio.get_running_loop()

        def structured_of(req):
            return req.params.structured_outputs if req.params is not None else None

        def work():
            body = protocol.parse_json(raw)
            model = model_of(body)
            req = parse(body, b)
            if structured_of(req) is not None:
                return req, model, None
            engine_check(b, req)          # in the same hop: one worker round trip a request
            return req, model, start(req, model, loop)

        def dropped(result):
            if result[2] is not None:
                result[2][1]()            # its finish: the engine requests closed, the admission given back
        req, model, started = await off_loop_owned(work, dropped)
        if started is None:
            # compiled in the engine's worker, within its time limit; then found compiled below
            await structured.check(b.engine, req.params.structured_outputs)
            await off_loop(engine_check, b, req)
        return req, model, started

    def start(req: protocol.GenRequest, model: str, loop):
        """Admit the request (429 past capacity) and queue its engine requests: (Generation, its
        finish: close the engine requests the reply never read, give the admission back; both
        idempotent). Runs on the loop or the pool."""
        release = admission.admit(state, req)
        g = Generation(state, req, model)
        try:
            g.start(loop)
        except BaseException as e:
            release()
            if isinstance(e, EngineDeadError):   # died since backend() looked: 503, as there
                raise engine_error(e) from None
            raise

        def finish():
            g.close()
            release()
        return g, finish

    async def serve(request: Request, req: protocol.GenRequest, model: str, started=None, render=None):
        """render(body) -> the reply's body (/v1/responses: the chat completion as a Response).
        started: checked's (Generation, finish), or None to admit and queue the request here."""
        g, done = started or start(req, model, asyncio.get_running_loop())
        if req.stream:
            return SSEResponse(g.stream(), done)
        try:
            body = await until_disconnect(request, g.collect())
            return json_response(render(body) if render else body)
        except ClientGone:
            return Response(status_code=499)
        except APIError:
            raise
        except Exception as e:  # noqa: BLE001
            raise engine_error(e) from None
        finally:
            done()

    async def guarded(request: Request, handler):
        try:
            return await handler()
        except ClientGone:
            return Response(status_code=499)

    @app.post("/v1/completions")
    async def completions(request: Request):
        async def go():
            req, model, started = await checked(request, lambda body, b: outputs.completion(
                body, lambda: protocol.parse_completion(body, state.limits, b.tokenizer)))
            return await serve(request, req, model, started)
        return await guarded(request, go)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        async def go():
            req, model, started = await checked(request, lambda body, b: outputs.chat(
                body, state, b.tokenizer, lambda: protocol.parse_chat(
                    body, state.limits, b.tokenizer, state.template, state.special,
                    cfg.trust_request_chat_template)))
            return await serve(request, req, model, started)
        return await guarded(request, go)

    @app.post("/v1/responses")
    async def create_response(request: Request):
        async def go():
            seen = {}

            def parse(body, b):
                seen["body"] = body
                return outputs.response(body, lambda: protocol.parse_chat(
                    responses.chat_body(body), state.limits, b.tokenizer, state.template, state.special,
                    cfg.trust_request_chat_template))
            req, model, started = await checked(request, parse)
            return await serve(request, req, model, started, lambda chat: responses.response(seen["body"], chat))
        return await guarded(request, go)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        backend()
        await body_of(request)         # a JSON route like the others (415, 413), then vLLM's answer
        raise responses.embeddings_unsupported()

    def model_card(name: str) -> dict:
        b = state.backend
        if name not in cfg.served_model_names:        # a LoRA adapter: its path, the base its parent
            return {"id": name, "object": "model", "created": state.created, "owned_by": "infc",
                    "root": b.engine.engine.loras.paths.get(name), "parent": cfg.served_model_names[0],
                    "max_model_len": b.max_model_len}
        return {"id": name, "object": "model", "created": state.created, "owned_by": "infc",
                "root": cfg.root or (str(b.model_dir) if b else name), "parent": None,
                "max_model_len": b.max_model_len if b else None}

    @app.get("/v1/models")
    async def models():
        backend()
        names = cfg.served_model_names + loras()
        return json_response({"object": "list", "data": [model_card(n) for n in names]})

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        backend()
        if name not in cfg.served_model_names and name not in loras():
            raise APIError(404, f"The model `{name}` does not exist.", "invalid_request_error", "model",
                           "model_not_found")
        return json_response(model_card(name))

    async def lora_body(request: Request) -> dict:
        """The body of a load / unload request, once the server allows them."""
        b = backend()
        if not cfg.allow_runtime_lora_updating:
            raise APIError(404, "loading LoRA adapters at run time is off (serve with "
                           "--allow-runtime-lora-updating)", "invalid_request_error", code="not_found")
        if not hasattr(b.engine, "load_lora") or b.engine.engine.loras is None:
            raise bad("this model serves no LoRA adapters (serve it with --enable-lora)")
        body = protocol.parse_json(await body_of(request))
        name = body.get("lora_name")
        if not isinstance(name, str) or not name:
            raise bad("'lora_name' (a string) is required", "lora_name")
        return body

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        b = backend()
        body = await lora_body(request)
        name, path = body["lora_name"], body.get("lora_path")
        if not isinstance(path, str) or not path:
            raise bad("'lora_path' (a string) is required", "lora_path")
        if name in cfg.served_model_names:
            raise bad(f"LoRA adapter name '{name}' is the base model's name", "lora_name")
        try:
            await b.engine.load_lora(name, path)
        except ValueError as e:                       # AdapterError: what is wrong, nothing loaded
            raise bad(str(e), "lora_path") from None
        return Response(f"Success: LoRA adapter '{name}' added successfully.".encode(),
                        media_type="text/plain")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        b = backend()
        body = await lora_body(request)
        name = body["lora_name"]
        try:
            await b.engine.unload_lora(name)
        except ValueError as e:
            raise APIError(404, str(e), "invalid_request_error", "lora_name", "not_found") from None
        return Response(f"Success: LoRA adapter '{name}' removed successfully.".encode(),
                        media_type="text/plain")

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        """vLLM's: forget the cached prefix blocks (KV-event subscribers get AllBlocksCleared)."""
        await backend().engine.reset_prefix_cache()
        return Response(status_code=200)

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
            raw = await body_of(request)
            return json_bytes_response(await off_loop(tokenized, b, raw))
        return await guarded(request, go)

    def tokenized(b, raw: bytes) -> bytes:
        body = protocol.parse_json(raw)
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
        return dumps(out)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        async def go():
            b = backend()
            raw = await body_of(request)
            return json_bytes_response(await off_loop(detokenized, b, raw))
        return await guarded(request, go)

    def detokenized(b, raw: bytes) -> bytes:
        body = protocol.parse_json(raw)
        model_of(body)
        tok = tokenizer_or_400(b)
        ids = protocol.token_ids(body.get("tokens"), "tokens", b.vocab_size, protocol.MAX_DETOKENIZE)
        return dumps({"prompt": tok.decode(ids, skip_special_tokens=False)})

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

    star = Starlette(routes=app.routes, exception_handlers={
        APIError: _api_error, StarletteHTTPException: _http_error, Exception: _internal})
    star.state.infc = state
    return Guard(star, state)


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("infc")
    except Exception:  # noqa: BLE001
        return "unknown"
