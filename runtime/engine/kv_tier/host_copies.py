"""The CPU runner's side of the KV tiers: pages of its numpy caches to and from rows of a numpy
slab (compiler/contract/caches.py HostCaches.read_pages / write_pages). Copies are done when
issued, so fences are None and waiting is free. The CUDA runner's counterpart, with a copy
stream and events, is runtime/cuda/kv_copies.py; KVTiers (tiers.py) uses either."""
import time

import numpy as np


class HostCopies:
    def __init__(self, storage):
        self.storage = storage
        self.block_bytes = storage.block_bytes
        self.slab: np.ndarray | None = None
        self.seconds = {True: None, False: None}  # the last save's (True) and load's copy time

    def make_slab(self, rows: int) -> np.ndarray:
        self.slab = np.zeros((rows, self.block_bytes), np.uint8)
        return self.slab

    def save(self, pages, rows):
        """Pages -> slab rows."""
        t0 = time.perf_counter()
        self.storage.read_pages(pages, self.slab, rows)
        self.seconds[True] = time.perf_counter() - t0

    def load(self, pages, rows, after_steps: bool = True):
        """Slab rows -> pages (after_steps: see runtime/cuda/kv_copies.py; the CPU's steps are done)."""
        t0 = time.perf_counter()
        self.storage.write_pages(pages, self.slab, rows)
        self.seconds[False] = time.perf_counter() - t0

    def last_ms(self, to_host: bool) -> float | None:
        """How long the last batch of saves (to_host) or loads took to copy (benchmarks)."""
        s = self.seconds[to_host]
        return None if s is None else s * 1e3

    def step_waits(self, fence):
        """The next step waits for the copies up to fence (nothing to wait for here)."""

    def host_wait(self, fence):
        """The host waits for the copies up to fence (nothing to wait for here)."""

    def close(self):
        self.slab = None
