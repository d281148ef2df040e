"""server/offload.py's off_loop_owned: a result that holds something (an admitted request queued
to the engine on the worker pool) is never lost with a cancelled wait."""
import asyncio
import threading

import pytest

from infc.server.offload import off_loop_owned


def test_a_result_left_by_a_cancelled_wait_is_given_back():
    started, go, dropped = threading.Event(), threading.Event(), []

    def work():
        started.set()
        go.wait(5)
        return "held"

    async def main():
        task = asyncio.create_task(off_loop_owned(work, dropped.append))
        await asyncio.to_thread(started.wait, 5)
        task.cancel()                     # the handler is cancelled while the pool still works
        with pytest.raises(asyncio.CancelledError):
            await task
        assert dropped == []              # not before the work is done
        go.set()
        for _ in range(500):
            if dropped:
                break
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert dropped == ["held"]


def test_a_result_awaited_or_an_error_is_not_given_back():
    dropped = []

    def fail():
        raise ValueError("bad request")

    async def main():
        assert await off_loop_owned(lambda: 7, dropped.append) == 7
        with pytest.raises(ValueError, match="bad request"):
            await off_loop_owned(fail, dropped.append)

    asyncio.run(main())
    assert dropped == []
