"""runtime/cuda/collective_clock.py on fake events: only steps' collectives are timed (not a
graph capture's), the time of each is summed by program and op, and a report starts afresh."""
from infc.runtime.cuda.collective_clock import CollectiveClock


class _Ctx:
    """Events that read a clock advanced by each fired collective."""
    def __init__(self):
        self.now, self.made = 0.0, 0

    def event(self):
        self.made += 1
        ctx = self

        class Event:
            def record(self):
                self.t = ctx.now

            def ms_since(self, start):
                return self.t - start.t
        return Event()


def test_only_steps_are_timed_and_summed_by_program_and_op():
    ctx = _Ctx()
    clock = CollectiveClock(ctx)
    fired = []

    def collective(ms):
        def fire(dims):
            fired.append(dims["T"])
            ctx.now += ms
        return fire

    gather, scatter = clock.wrap("dp_dispatch", collective(1.5)), clock.wrap("dp_combine", collective(4.0))
    gather({"T": 1})                        # phase None: a capture's launch, not timed
    assert fired == [1] and not clock.pending
    clock.phase = "mixed"
    for _ in range(3):
        gather({"T": 8})
        scatter({"T": 8})
    clock.phase = "decode"
    scatter({"T": 2})
    clock.phase = None
    assert fired == [1] + [8] * 6 + [2]
    rep = clock.report()
    assert rep == {"mixed": {"dp_combine": {"launches": 3, "ms": 12.0},
                             "dp_dispatch": {"launches": 3, "ms": 4.5}},
                   "decode": {"dp_combine": {"launches": 1, "ms": 4.0}}}
    made = ctx.made
    clock.phase = "mixed"
    gather({"T": 8})                        # event pairs are reused after a report
    assert ctx.made == made
    assert clock.report() == {"mixed": {"dp_dispatch": {"launches": 1, "ms": 1.5}}}
    assert clock.report() == {}
