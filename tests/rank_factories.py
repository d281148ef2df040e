"""Rank runner factories of the rank-process tests (tests/test_rank_workers.py,
tests/test_rank_workers_dp.py), named to MultiProcessRunner as "rank_factories:<name>".

A spawned worker imports the module its factory lives in: this one imports only the runtime, so a
worker starts in about a second; a factory in a test module would import that module's torch,
transformers and compiler (~3 s more on each worker of each runner)."""
import threading

from infc.runtime.engine.runner import ComputedAtLaunch, Sample


# -- the watchdog (a collective that would wait forever, as NCCL's does for a dead rank) -------
class _Blocking:
    """A runner whose rank 0 step waits, like an NCCL collective, until abort() is called."""
    num_pages, page_size, num_slots, vocab_size = 8, 16, 0, 10

    def __init__(self, rank):
        self.rank, self.released, self.aborted = rank, threading.Event(), False

    def execute(self, meta, sampling):
        if self.rank == 0 and meta.T == 2:
            if not self.released.wait(60):
                return "hung"
            raise RuntimeError("ncclCommAbort: the collective was aborted")
        return [None] * meta.B

    def abort(self):
        self.aborted = True
        self.released.set()


def blocking_factory(rank, world, config, link):
    return _Blocking(rank)


# -- data-parallel rank runners without a model: frees and the acknowledgement bookkeeping ------
class _Counting:
    """A data-parallel rank runner whose samples say which rank sampled and how many sequences
    it was told to free."""
    num_pages, page_size, num_slots, vocab_size = 8, 16, 0, 10

    def __init__(self, rank, world):
        self.rank, self.freed = rank, []
        self.plan = {"parallel": {"world": world, "rank": rank, "dp": world}}

    def execute(self, meta, sampling):
        return [None if s is None else Sample(100 * self.rank + 10 * len(self.freed) + b,
                                              -0.5 * self.rank, [(self.rank, -0.5)] * self.rank)
                for b, s in enumerate(sampling)]

    def free(self, seq_id):
        self.freed.append(seq_id)


def counting_factory(rank, world, config, link):
    return _Counting(rank, world)


class _CountingLaunch(ComputedAtLaunch, _Counting):
    """_Counting with the overlapped interface (computed at launch, as the CPU runner's)."""


def counting_launch_factory(rank, world, config, link):
    return _CountingLaunch(rank, world)


# -- failures -----------------------------------------------------------------------------------
def raising_factory(rank, world, config, link):
    """The reference rank runner, whose rank 1 raises in its second data-parallel step."""
    from infc.runtime.distributed.rank_runners import reference_rank_runner
    runner = reference_rank_runner(rank, world, config, link)
    execute, calls = runner.execute, []

    def flaky(meta, sampling):
        calls.append(1)
        if rank == 1 and len(calls) == 2:
            raise RuntimeError("rank 1 lost its experts")
        return execute(meta, sampling)
    runner.execute = flaky
    return runner


def _raising_in(where: str):
    def factory(rank, world, config, link):
        """The reference rank runner, whose rank 1 raises in its second launch or first collect."""
        from infc.runtime.distributed.rank_runners import reference_rank_runner
        runner = reference_rank_runner(rank, world, config, link)
        fn, calls = getattr(runner, where), []

        def flaky(*a):
            calls.append(1)
            if rank == 1 and len(calls) == (2 if where == "launch" else 1):
                raise RuntimeError(f"rank 1 lost its experts in {where}")
            return fn(*a)
        setattr(runner, where, flaky)
        return runner
    return factory


raising_launch_factory = _raising_in("launch")
raising_collect_factory = _raising_in("collect")
