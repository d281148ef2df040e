"""One request's way through the engine and its OpenAI rendering: the engine requests of its
prompts and choices merged into one stream, prompt logprobs for echo, and the completion / chat
responses, whole or as SSE chunks."""
import asyncio
import time
import uuid
from dataclasses import dataclass, field

from infc.runtime.engine import best_of
from infc.runtime.engine.async_engine import EngineDeadError
from infc.runtime.lora.tables import AdapterNotLoaded

from . import protocol, scoring
from .chat_output import AnswerPlan
from .http import sse
from .protocol import APIError, bad
from .state import ServerState


# -- the engine's outputs -----------------------------------------------------------------------
async def merged(opened: list):
    """(job index, StepOutput) from several opened engine requests (AsyncEngine.open) at once;
    closing or cancelling the consumer closes every request (each aborts in the engine). One
    request (most: one prompt, n choices in one request) is read directly: no task, no second
    queue on each output's way to the client."""
    if len(opened) == 1:
        req = opened[0]
        try:
            async for out in req:
                yield 0, out
        finally:
            req.close()
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(k, req):
        try:
            async for out in req:
                q.put_nowait((k, out))
        except asyncio.CancelledError:
            raise
        except BaseException as e:   # noqa: BLE001 - handed to the consumer
            q.put_nowait((k, e))
            return
        finally:
            req.close()
        q.put_nowait((k, None))

    tasks = [asyncio.create_task(pump(k, req)) for k, req in enumerate(opened)]
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
        for req in opened:
            req.close()


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
    if isinstance(e, AdapterNotLoaded):        # unloaded after the model check: unknown now, as there
        return APIError(404, f"The model `{e.name}` does not exist: {e}.", "invalid_request_error", "model",
                        "model_not_found")
    if isinstance(e, ValueError):
        return bad(str(e))
    return APIError(500, f"internal error: {type(e).__name__}: {e}", "server_error")


def tool_finish(finish: str | None, called: bool) -> str | None:
    """An answer that ended by itself with tool calls finished for them (OpenAI's reason)."""
    return "tool_calls" if called and finish == "stop" else finish


async def _chain(first: list, rest):
    """The items of a list, then of an async iterator."""
    for x in first:
        yield x
    async for x in rest:
        yield x


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
        # a model named by a LoRA adapter (not one of the served names) runs with that adapter
        self.lora = None if model in state.config.served_model_names else model
        self.b = state.backend
        self.engine = self.b.engine
        self.chat = req.kind == "chat"
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.object = "chat.completion" if self.chat else "text_completion"
        self.prompt_logprobs: list = [None] * len(req.prompts)   # engine entries, one list a prompt
        self.cached_tokens = [0] * len(req.prompts)               # prefix-cache hits, a prompt's
        self.prompt_tokens = sum(len(p) for p in req.prompts)
        self.params = scoring.engine_params(self.engine, req)
        self.in_engine = scoring.in_engine(self.engine, req)
        self.opened: list | None = None       # its engine requests, once queued (start)

    # engine requests
    def jobs(self):
        if self.params is None:
            return []
        params = best_of.candidates(self.params)
        return [(k, ids, params, f"{self.id}-{k}") for k, ids in enumerate(self.req.prompts)]

    def start(self, loop: asyncio.AbstractEventLoop):
        """Queue the request's engine requests (their prompts and params checked: app.checked),
        from the event loop or the worker pool; outputs() reads them on `loop`. The caller closes."""
        self.opened = []
        try:
            for _, ids, params, rid in self.jobs():
                # app.checked ran the engine's check on every prompt of the request before replying
                self.opened.append(self.engine.open(ids, params, rid, loop, lora=self.lora,
                                                    cache_salt=self.req.cache_salt))
        except BaseException:
            self.close()
            raise

    def close(self):
        """Abort whichever engine requests of this one still run (idempotent, any thread)."""
        for req in self.opened or ():
            req.close()

    def outputs(self):
        """(job index, StepOutput) as they come, the engine requests queued now if not yet."""
        if self.opened is None:
            self.start(asyncio.get_running_loop())
        return merged(self.opened)

    def index(self, k: int, i: int) -> int:
        return k * self.req.n + i

    def seen(self, k: int, out) -> bool:
        """Note what an engine output brings for prompt k besides tokens (its prompt logprobs,
        its cache hits); whether its tokens are the client's (not echo's one dropped token)."""
        if out.prompt_logprobs is not None:
            self.prompt_logprobs[k] = out.prompt_logprobs
        if out.index == 0 and out.token_ids:
            self.cached_tokens[k] = out.num_cached_tokens
        return self.req.params is not None

    async def score_prompts(self):
        """Prompt logprobs for echo where the engine does not score prompt rows: the forced-token
        path (scoring.forced_token_logprobs)."""
        if self.in_engine or not (self.req.echo and self.req.logprobs is not None):
            return

        async def one(k, ids):
            self.prompt_logprobs[k] = await scoring.forced_token_logprobs(
                self.engine, ids, self.req.logprobs, self.b.vocab_size, f"{self.id}-{k}", lora=self.lora,
                cache_salt=self.req.cache_salt)

        await run_all(*(one(k, ids) for k, ids in enumerate(self.req.prompts)))

    def echo_entries(self, k: int) -> list:
        """Prompt k's logprob entries as echo shows them: the first token has none."""
        ids, top = self.req.prompts[k], self.req.logprobs
        return ([{"token": ids[0], "logprob": None, "top": None}]
                + [scoring.with_top(e, top) for e in self.prompt_logprobs[k][1:]])

    def vllm_prompt_logprobs(self, k: int) -> list | None:
        """vLLM's `prompt_logprobs` of prompt k: None first, then {token id: {logprob, rank,
        decoded_token}} holding the prompt's token and the top k."""
        if self.req.prompt_logprobs is None:
            return None
        out = [None]
        for e in self.prompt_logprobs[k][1:]:
            d = {str(e["token"]): {"logprob": e["logprob"], "rank": e["rank"],
                                   "decoded_token": self.state.token_str(e["token"])}}
            for r, (t, lp) in enumerate(e["top"][:self.req.prompt_logprobs], 1):
                d.setdefault(str(t), {"logprob": lp, "rank": r, "decoded_token": self.state.token_str(t)})
            out.append(d)
        return out

    def echo_text(self, k: int) -> str:
        t = self.req.texts[k]
        if t is None:
            t = self.b.tokenizer.decode(self.req.prompts[k], skip_special_tokens=False)
        return t

    def usage(self, completion_tokens: int) -> dict:
        u = {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
             "total_tokens": self.prompt_tokens + completion_tokens}
        if self.state.config.enable_prompt_tokens_details:
            u["prompt_tokens_details"] = {"cached_tokens": sum(self.cached_tokens)}
        return u

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
        drawn = self.req.params.best_of if self.req.params and self.req.params.best_of else self.req.n
        choices = {(k, i): _Choice() for k in range(len(self.req.prompts)) for i in range(drawn)}

        async def gen():
            async for k, out in self.outputs():
                if not self.seen(k, out):
                    continue
                c = choices[(k, out.index)]
                c.text += out.text
                c.token_ids += out.token_ids
                if out.logprobs:
                    c.logprobs += out.logprobs
                if out.finished:
                    c.finish_reason, c.stop_reason = out.finish_reason, out.stop_reason

        await run_all(gen(), self.score_prompts())
        generated = sum(len(c.token_ids) for c in choices.values())    # every candidate's
        if drawn > self.req.n:
            choices = {(k, i): c for k in range(len(self.req.prompts)) for i, c in enumerate(best_of.choose(
                [choices[(k, j)] for j in range(drawn)], self.req.n, lambda c: c.logprobs))}
        out = []
        for (k, i), c in choices.items():
            idx = self.index(k, i)
            finish = c.finish_reason or "length"
            if self.chat:
                message, called = self.plan().message(c.text)
                out.append({"index": idx, "message": message,
                            "logprobs": self.chat_logprobs(c.logprobs) if self.req.logprobs is not None else None,
                            "finish_reason": tool_finish(finish, called), "stop_reason": c.stop_reason})
                continue
            text, lp = c.text, None
            if self.req.echo:
                text = self.echo_text(k) + text
            if self.req.logprobs is not None:
                entries = (self.echo_entries(k) if self.req.echo else []) + c.logprobs
                lp, _ = self.completion_logprobs(entries, 0)
            out.append({"index": idx, "text": text, "logprobs": lp, "finish_reason": finish,
                        "stop_reason": c.stop_reason, "prompt_logprobs": self.vllm_prompt_logprobs(k)})
        out.sort(key=lambda c: c["index"])
        body = {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": out, "usage": self.usage(generated)}
        if self.chat:                      # vLLM's chat response carries them beside the choices
            body["prompt_logprobs"] = self.vllm_prompt_logprobs(0)
        return body

    def plan(self) -> AnswerPlan:
        return self.req.answer or AnswerPlan()

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
        answers: dict = {}                     # chat: each choice's AnswerStream
        outs = None
        try:
            outs = self.outputs()
            live = self.usage(0) if req.continuous_usage else None
            if self.chat:
                yield self.chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                   "logprobs": None, "finish_reason": None} for i in range(req.n)], live)
            held = []
            if req.echo:
                # each prompt's logprobs come with its first output (held back until all have)
                while self.in_engine and req.logprobs is not None and None in self.prompt_logprobs:
                    k, out = await anext(outs, (None, None))
                    if out is None:
                        raise RuntimeError("the engine ended a request without its prompt logprobs")
                    held.append((k, out))
                    self.seen(k, out)
                await self.score_prompts()       # the forced-token path (nothing where the engine scores)
                first = []
                for k in range(len(req.prompts)):
                    for i in range(req.n):
                        lp = None
                        if req.logprobs is not None:
                            lp, offsets[self.index(k, i)] = self.completion_logprobs(self.echo_entries(k), 0)
                        first.append({"index": self.index(k, i), "text": self.echo_text(k), "logprobs": lp,
                                      "finish_reason": None if req.params else "length", "stop_reason": None})
                yield self.chunk(first, live)
            async for k, out in _chain(held, outs):
                if not self.seen(k, out):
                    continue
                idx = self.index(k, out.index)
                done_tokens += len(out.token_ids)
                if not (out.text or out.finished or (req.logprobs is not None and out.logprobs)):
                    continue
                if self.chat:
                    answer = answers.setdefault(idx, self.plan().stream())
                    deltas = answer.feed(out.text, out.finished)
                    if not (deltas or out.finished or (req.logprobs is not None and out.logprobs)):
                        continue
                    lp = self.chat_logprobs(out.logprobs or []) if req.logprobs is not None else None
                    deltas = deltas or [{}]
                    for j, d in enumerate(deltas):
                        last = j == len(deltas) - 1
                        c = {"index": idx, "delta": d, "logprobs": lp if j == 0 else None,
                             "finish_reason": tool_finish(out.finish_reason, answer.called) if last else None,
                             "stop_reason": out.stop_reason if last else None}
                        yield self.chunk([c], self.usage(done_tokens) if req.continuous_usage and last else None)
                    continue
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
        finally:
            if outs is not None:
                await outs.aclose()        # its engine requests abort if they still run
            self.close()                   # (also those queued before a never-started outs)
        yield b"data: [DONE]\n\n"
