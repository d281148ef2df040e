"""A minimal page allocator + step loop over a runner, for tests and benchmarks that drive the
runner directly (the engine adds scheduling, prefix caching and stop handling on top)."""
import numpy as np

from infc.runtime.step import Chunk, build_step


class Pages:
    def __init__(self, num_pages: int, page_size: int):
        self.free = list(range(num_pages))[::-1]
        self.page_size = page_size
        self.of: dict[int, list[int]] = {}

    def ensure(self, seq: int, tokens: int, shared: list[int] | None = None):
        pages = self.of.setdefault(seq, list(shared or []))
        while len(pages) * self.page_size < tokens:
            pages.append(self.free.pop())

    def release(self, seq: int, keep: int = 0):
        for p in self.of.pop(seq)[keep:]:
            self.free.append(p)


def step(runner, pages: Pages, chunks: list[Chunk]) -> np.ndarray:
    for c in chunks:
        pages.ensure(c.seq_id, c.start + len(c.tokens))
    meta = build_step(chunks, pages.of.__getitem__, pages.page_size)
    return runner.logits(meta).copy()
