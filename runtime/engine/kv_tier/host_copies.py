"""The CPU runner's side of the KV tiers: pages of its numpy caches to and from rows of a numpy
slab (compiler/contract/caches.py HostCaches.read_pages / write_pages). Copies are done when
issued, so fences are None and waiting is free. The CUDA runner's counterpart, with a copy
stream and events, is runtime/cuda/kv_copies.py; KVTiers (tiers.py) uses either."""
import numpy as np


class HostCopies:
    def __init__(self, storage):
        self.storage = storage
        self.block_bytes = storage.block_bytes
        self.slab: np.ndarray | None = None

    def make_slab(self, rows: int) -> np.ndarray:
        self.slab = np.zeros((rows, self.block_bytes), np.uint8)
        return self.slab

    def save(self, pages, rows):
        """Pages -> slab rows."""
        self.storage.read_pages(pages, self.slab, rows)

    def load(self, pages, rows):
        """Slab rows -> pages."""
        self.storage.write_pages(pages, self.slab, rows)

    def step_waits(self, fence):
        """The next step waits for the copies up to fence (nothing to wait for here)."""

    def host_wait(self, fence):
        """The host waits for the copies up to fence (nothing to wait for here)."""

    def close(self):
        self.slab = None
