"""The worker pool that keeps the event loop routing (docs/architecture.md, contract 17).

Whatever grows with a request's size runs here, not on the loop: JSON parsing of the body,
chat templating, tokenization, detokenization and the token-id checks (the prompt's ids against
the vocabulary and the engine's own rules). The loop only reads the bounded body, admits, and
relays engine outputs, so /health and every stream in flight keep answering while a large
request is parsed or refused.

One pool per process, shared by every server in it (tests run several); its threads start on
first use. Its size is the machine's: the cores plus a few (Python's own default for a pool), so that a
small request is not queued behind a few long tokenizations (the tokenizers library releases
the GIL and runs its own threads inside each call; the kernel shares the cores among them).

What a thread pool cannot do: a single C call that holds the GIL (json.loads of a 16 MiB body,
20-45 ms here) still delays the loop by that long (longer when the OS preempts the thread that
holds it); the cheap bounds in protocol.py make sure nothing bigger follows for a request that
can never fit.
"""
import asyncio
import functools
import os
from concurrent.futures import ThreadPoolExecutor


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:            # not Linux
        return os.cpu_count() or 1


WORKERS = min(32, _cores() + 4)       # the pool's size: one home for it

POOL = ThreadPoolExecutor(WORKERS, thread_name_prefix="infc-offload")


async def off_loop(fn, *args, **kw):
    """fn(*args, **kw) on the worker pool; its result or its exception, here."""
    return await asyncio.get_running_loop().run_in_executor(POOL, functools.partial(fn, *args, **kw))


async def off_loop_owned(fn, dropped):
    """off_loop(fn) for a fn whose result holds something to give back (an admitted, queued
    request): if the awaiting task is cancelled (shutdown, a client gone), dropped(result) runs
    once fn is done, on the pool thread, instead of the result being lost with its holdings."""
    cf = POOL.submit(fn)
    try:
        return await asyncio.wrap_future(cf)
    except asyncio.CancelledError:
        def give_back(f):
            if not f.cancelled() and f.exception() is None:
                dropped(f.result())
        cf.add_done_callback(give_back)
        raise
