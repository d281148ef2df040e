"""AsyncEngine: the one door in and out of the engine for the server.

    engine = AsyncEngine(Engine(...))
    async for out in engine.generate(prompt_ids, params, "req-1"):   # StepOutputs, as they come
        ...
    await engine.abort("req-1")

One background thread owns the Engine and steps it while there is work; with none it sleeps on
an event (no busy spin). Callers never touch the Engine: they queue commands (add, abort) that
the thread applies between steps, and it hands outputs back to each caller's asyncio queue with
loop.call_soon_threadsafe. A consumer that stops iterating, or is cancelled (a client
disconnect), aborts its request, so its KV is freed at the next step boundary. A request the
engine failed (its output handling raised, or its step was lost: Engine.step) raises
RequestFailedError in its consumer alone; the engine goes on. If a step raises (what
engine.is_fatal calls fatal: the device or the ranks are gone), the engine is dead: `healthy`
turns False and every waiter gets EngineDeadError instead of hanging.
"""
import asyncio
import concurrent.futures
import threading

from .engine import Engine, StepOutput, is_fatal
from .sampling import SamplingParams
from .sequence import PromptIds
from .structured.request import StructuredOutputs
from ..lora.tables import AdapterNotLoaded


class EngineDeadError(RuntimeError):
    pass


class RequestFailedError(RuntimeError):
    """The engine failed this request (not the client's fault; the engine lives on)."""


def _failed(e: Exception) -> Exception:
    """What the consumer of a request the engine ended with e raises: e itself where it is about
    the request, not the engine (its adapter unloaded while it waited: the server answers an
    unknown model's 404), else RequestFailedError."""
    if isinstance(e, AdapterNotLoaded):
        return e
    return RequestFailedError(f"the request failed in the engine: {type(e).__name__}: {e}")


class Opened:
    """One queued engine request: iterate it (once, on its loop) for its StepOutputs until all its
    sequences are finished; close() (idempotent, any thread) forgets it and, unfinished, aborts it,
    so its KV is freed at the next step boundary."""

    def __init__(self, engine: "AsyncEngine", request_id: str, queue: asyncio.Queue):
        self.engine, self.request_id, self.queue = engine, request_id, queue
        self.done = self.closed = False

    async def __aiter__(self):
        try:
            while not (self.done or self.closed):     # closed: aborted, its outputs stale
                out = await self.queue.get()
                if isinstance(out, BaseException):
                    self.done = True
                    raise out
                self.done = out.request_finished
                yield out
        finally:
            self.close()

    def close(self):
        if self.closed:
            return
        self.closed = True
        eng = self.engine
        with eng._lock:
            eng._queues.pop(self.request_id, None)
        if not self.done:
            eng._send(("abort", self.request_id))


class AsyncEngine:
    def __init__(self, engine: Engine):
        self.engine = engine
        self.healthy = True
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._commands: list[tuple] = []
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._calls: set = set()                 # engine-thread calls (LoRA loads) not yet run
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="infc-engine", daemon=True)
        self._thread.start()

    # -- the door -------------------------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                       checked: bool = False, counted: bool = True, lora: str | None = None,
                       cache_salt: str | None = None):
        """Yield this request's StepOutputs until all its sequences are finished. checked: the
        caller ran engine.check_request on these ids (a list of int) and params already (the
        server does, for every prompt of a request before it replies). counted=False: a request
        the server makes for itself, left out of the metrics. lora: a loaded adapter's name.
        cache_salt: Engine.add_request's."""
        self._raise_if_dead()
        if not checked:
            if params.structured_outputs is not None:      # compiled off the loop, then cached
                await self.check_structured(params.structured_outputs)
            prompt_ids = self.engine.checked_ids(prompt_ids, params)   # a bad request fails here, at once
        req = self.open(prompt_ids, params, request_id, asyncio.get_running_loop(), counted, lora, cache_salt)
        try:
            async for out in req:
                yield out
        finally:
            req.close()

    def open(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
             loop: asyncio.AbstractEventLoop, counted: bool = True, lora: str | None = None,
             cache_salt: str | None = None) -> "Opened":
        """Queue a checked request (see generate) from any thread: the engine takes it at its next
        step boundary, and its outputs go to `loop`, where the returned Opened yields them. The
        server opens a request on its worker pool as soon as the request is checked, so the step
        starts while the event loop still sets up the reply. Whoever opens must close.
        cache_salt: Engine.add_request's."""
        self._raise_if_dead()
        queue = asyncio.Queue()                  # bound to `loop` when first awaited there
        with self._lock:
            if request_id in self._queues:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._queues[request_id] = (loop, queue)
        try:
            self._raise_if_dead()                # it may have died since: nobody would tell us
        except EngineDeadError:
            with self._lock:
                self._queues.pop(request_id, None)
            raise
        # a copy (the caller's list is its own), with the check's array where the ids carry one
        ids = PromptIds(prompt_ids, prompt_ids.array) if isinstance(prompt_ids, PromptIds) else list(prompt_ids)
        self._send(("add", ids, params, request_id, counted, lora, cache_salt))
        return Opened(self, request_id, queue)

    async def check_structured(self, so: StructuredOutputs) -> None:
        """Compile a request's structured output (or find it compiled) in a worker thread, within
        the time limit (config STRUCTURED_COMPILE_TIMEOUT_S): StructuredOutputError, whose
        `field` names the request field, for a schema, regex, choice or grammar that is refused or
        compiles too slowly. The server awaits it before it queues the request; the engine thread
        then finds the grammar compiled. Never blocks the event loop."""
        await asyncio.to_thread(self.engine.grammars.check, so)

    async def load_lora(self, name: str, path: str) -> int:
        """Register a LoRA adapter (runtime/lora/slots.py): read and checked in a worker thread,
        registered on the engine's thread between steps; its lora_id, or the AdapterError that
        left everything as it was."""
        loras = self._loras()
        loras.check_free(name)                   # before the read; register checks it again
        prepared = await asyncio.to_thread(loras.prepare, name, path)
        return await self._on_thread(lambda: loras.register(name, path, prepared))

    async def unload_lora(self, name: str):
        await self._on_thread(lambda: self._loras().unregister(name))

    def lora_names(self) -> list[str]:
        loras = self.engine.loras
        return [] if loras is None else list(loras.ids)

    def _loras(self):
        if self.engine.loras is None:
            raise ValueError("this model serves no LoRA adapters (serve it with --enable-lora)")
        return self.engine.loras

    async def _on_thread(self, fn):
        self._raise_if_dead()
        fut = concurrent.futures.Future()
        with self._lock:
            self._calls.add(fut)
        self._send(("call", fn, fut))
        try:
            self._raise_if_dead()            # it may have died since: nobody would run the call
        except EngineDeadError:
            with self._lock:
                self._calls.discard(fut)
            raise
        return await asyncio.wrap_future(fut)

    async def abort(self, request_id: str):
        self._send(("abort", request_id))

    async def reset_prefix_cache(self) -> bool:
        """Forget the cached prefix blocks, between steps (Engine.reset_prefix_cache)."""
        return await self._on_thread(self.engine.reset_prefix_cache)

    def shutdown(self, timeout: float = 10.0):
        self._stop = True
        self._wake.set()
        self._thread.join(timeout)
        self._fail_all(EngineDeadError("the engine was shut down"))
        if not self._thread.is_alive():          # else a step still runs: the process exit ends it
            self.engine.close()

    def fail(self, error: BaseException):
        """Mark the engine dead from outside its thread: what its runner saw fail while no step
        ran (a rank process that died while the server was idle). Waiters get EngineDeadError."""
        if not self.healthy:
            return
        self.error = error
        self.healthy = False
        self._stop = True
        self._wake.set()
        self._fail_all(EngineDeadError(f"the engine died: {error!r}"))

    # -- the thread -----------------------------------------------------------------------------
    def _send(self, cmd: tuple):
        with self._lock:
            self._commands.append(cmd)
        self._wake.set()

    def _raise_if_dead(self):
        if not self.healthy:
            raise EngineDeadError(f"the engine died: {self.error!r}") from self.error
        if self._stop:
            raise EngineDeadError("the engine was shut down")

    def _loop(self):
        try:
            while not self._stop:
                self._wake.clear()                # before draining: a later command sets it again
                with self._lock:
                    commands, self._commands = self._commands, []
                for cmd in commands:
                    self._apply(cmd)
                if not self.engine.has_unfinished():
                    self._wake.wait()
                    continue
                self._deliver(self.engine.step())
        except BaseException as e:              # noqa: BLE001 - any failure kills the engine loudly
            self.error = e
            self.healthy = False
            self._fail_all(EngineDeadError(f"the engine died: {e!r}"))

    def _apply(self, cmd: tuple):
        if cmd[0] == "abort":
            self.engine.abort(cmd[1])
            return
        if cmd[0] == "call":                   # load / unload an adapter: between steps
            _, fn, fut = cmd
            with self._lock:
                self._calls.discard(fut)
            try:
                fut.set_result(fn())
            except Exception as e:              # noqa: BLE001 - the caller's to report
                fut.set_exception(e)
            return
        _, prompt_ids, params, request_id, counted, lora, cache_salt = cmd
        with self._lock:
            if request_id not in self._queues:    # its consumer already left
                return
        try:
            self.engine.add_request(prompt_ids, params, request_id, checked=True, counted=counted,
                                    lora=lora, cache_salt=cache_salt)
        except ValueError as e:                 # one bad request, not a dead engine
            self._put(request_id, e)
        except Exception as e:                  # noqa: BLE001 - nor one that fails on its way in
            if is_fatal(e):
                raise
            self.engine.abort(request_id)       # whatever of it was added
            self._put(request_id, _failed(e))

    def _deliver(self, outputs: list[StepOutput]):
        for out in outputs:
            if out.error is not None:
                self._put(out.request_id, _failed(out.error))
            elif not self._put(out.request_id, out):
                self.engine.abort(out.request_id)     # nobody listens any more

    def _put(self, request_id: str, item) -> bool:
        with self._lock:
            target = self._queues.get(request_id)
        if target is None:
            return False
        loop, queue = target
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:                    # the caller's loop is closed
            return False
        return True

    def _fail_all(self, error: BaseException):
        with self._lock:
            targets = list(self._queues.values())
            calls, self._calls = self._calls, set()
        for fut in calls:
            if not fut.done():
                fut.set_exception(error)
        for loop, queue in targets:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, error)
            except RuntimeError:
                pass

    def stats(self) -> dict:
        """A snapshot of the engine's metrics (read from another thread: gauges may be a step old)."""
        m = self.engine.metrics
        return {k: getattr(m, k) for k in m.__dataclass_fields__}

    @property
    def scores_prompts(self) -> bool:
        """Whether requests may ask prompt logprobs (SamplingParams.prompt_logprobs)."""
        return self.engine.scores_prompts

    def check_request(self, prompt_ids: list[int], params: SamplingParams):
        """The engine's own rules for a request (ValueError if it can never run), from any thread:
        the server runs it on its worker pool, then generate(..., checked=True). Returns the
        prompt as the int64 array it checked (Engine.check_request)."""
        return self.engine.check_request(prompt_ids, params)
