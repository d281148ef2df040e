"""The CUDA runner's side of the KV tiers (runtime/engine/kv_tier/): device pages to and from rows
of a pinned host slab, on a copy stream of their own so the steps do not wait for them.

A batch of copies (a flush's saves, or its restores) first waits, on the device, for everything
issued on the main stream so far (the steps that wrote the pages, or still read a page being
restored over; restores skip that wait when KVTiers knows no step in flight has their pages, and
then overlap the step in flight), then issues one 2D copy per paged (cache, layer) and run of consecutive pages
(compiler/contract/caches.py DeviceCaches.block_copies), then records its fence: a number whose
event, in a ring, is recorded after the batch. The copy stream is in order, so waiting on a
later record of a ring event covers every earlier batch: step_waits makes the main stream wait
(on the device) and host_wait the host, for the batch `fence` and all before it.
"""
import numpy as np

RING = 16


class DeviceCopies:
    def __init__(self, ctx, device_caches):
        self.ctx, self.caches = ctx, device_caches
        self.block_bytes = device_caches.layout.block_bytes
        self.stream = ctx.new_stream()
        self.events = [ctx.event() for _ in range(RING)]
        self.mark = ctx.event()                  # the main stream's point a batch waits for
        self.issued = 0                          # batches issued; batch k's fence is k
        # around the last save (True) and load (False) batch on the copy stream (last_ms)
        self.timing = {d: (ctx.event(), ctx.event()) for d in (True, False)}
        self.timed = set()
        self.slab: np.ndarray | None = None

    def make_slab(self, rows: int) -> np.ndarray:
        self.ctx.ensure_current()
        self._pinned = self.ctx.pinned(rows * self.block_bytes)
        self.slab = self._pinned.reshape(rows, self.block_bytes)
        return self.slab

    def _batch(self, pages, rows, to_host: bool, after_steps: bool = True) -> int:
        ctx, host = self.ctx, self.slab.ctypes.data
        ctx.ensure_current()
        if after_steps:
            self.mark.record()
            ctx.wait_event(self.mark, self.stream)
        start, end = self.timing[to_host]
        start.record(self.stream)
        for dev, at, width, n, pitch in self.caches.block_copies(pages, rows, self.block_bytes):
            if to_host:
                ctx.copy2d(host + at, self.block_bytes, dev, pitch, width, n, True, self.stream)
            else:
                ctx.copy2d(dev, pitch, host + at, self.block_bytes, width, n, False, self.stream)
        end.record(self.stream)
        self.timed.add(to_host)
        fence, self.issued = self.issued, self.issued + 1
        self.events[fence % RING].record(self.stream)
        return fence

    def last_ms(self, to_host: bool) -> float | None:
        """The copy stream's time for the last batch of saves (to_host) or loads: waits for it
        (benchmarks)."""
        if to_host not in self.timed:
            return None
        start, end = self.timing[to_host]
        return end.ms_since(start)

    def save(self, pages, rows) -> int:
        """Pages -> slab rows, once the steps issued so far have written them."""
        return self._batch(pages, rows, True)

    def load(self, pages, rows, after_steps: bool = True) -> int:
        """Slab rows -> pages, once the steps issued so far are done (after_steps; False: no step
        issued so far touches these pages, the copies may run beside them)."""
        return self._batch(pages, rows, False, after_steps)

    def step_waits(self, fence: int):
        self.ctx.wait_event(self.events[fence % RING])

    def host_wait(self, fence):
        if fence is not None:
            self.events[fence % RING].wait()

    def close(self):
        if self.slab is not None:
            self.ctx.ensure_current()
            self.host_wait(self.issued - 1 if self.issued else None)
            self.ctx.free_pinned(self._pinned)
            self.slab = self._pinned = None
