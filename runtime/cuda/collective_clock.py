"""The time a rank's stream spends in its collectives, by op and step phase (INFC_COLLECTIVE_CLOCK=1).

Issue 14 asks why two ranks fall short of twice one GPU: the collectives' share of a step is
the number that decides between hiding them (micro-batches) and speeding the compute. An event
pair around each collective launch on the stream measures it where it is paid, waiting for the
slower rank included. Steps replayed from a CUDA Graph (decode buckets) are not timed: the
runner sets `phase` only around the launches of an eager step, never during a capture.

Off by default: the events add a little host time per collective and stop a programmatic
dependent launch from following a collective (it never does: runner._launch_all)."""

from infc import envs


def enabled() -> bool:
    return envs.value("INFC_COLLECTIVE_CLOCK")


class CollectiveClock:
    def __init__(self, ctx):
        self.ctx = ctx
        self.pool: list = []               # idle event pairs
        self.pending: list = []            # (key, start, end) recorded, not read yet
        self.totals: dict = {}             # (phase, op) -> [launches, ms]
        self.phase = None                  # the program being launched by a step (None: a capture)

    def wrap(self, op: str, fire):
        """fire(dims) with an event pair around it while a step (not a capture) is launched."""
        def timed(dims):
            if self.phase is None:
                return fire(dims)
            start, end = self.pool.pop() if self.pool else (self.ctx.event(), self.ctx.event())
            start.record()
            fire(dims)
            end.record()
            self.pending.append(((self.phase, op), start, end))
            if len(self.pending) > 4096:   # read the oldest back (they finished long ago)
                self.settle(len(self.pending) // 2)
        return timed

    def settle(self, n: int | None = None):
        """Read the first n recorded pairs (all: None) into the totals; waits for them."""
        n = len(self.pending) if n is None else n
        done, self.pending = self.pending[:n], self.pending[n:]
        for key, start, end in done:
            t = self.totals.setdefault(key, [0, 0.0])
            t[0] += 1
            t[1] += end.ms_since(start)
            self.pool.append((start, end))

    def report(self) -> dict:
        """{phase: {op: {"launches", "ms"}}} since the last report, then cleared."""
        self.settle()
        out: dict = {}
        for (phase, op), (n, ms) in sorted(self.totals.items()):
            out.setdefault(phase, {})[op] = {"launches": n, "ms": ms}
        self.totals = {}
        return out
