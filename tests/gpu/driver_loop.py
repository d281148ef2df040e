"""A minimal page allocator + step loop over a runner, for tests and benchmarks that drive the
runner directly (the engine adds scheduling, prefix caching and stop handling on top)."""
import numpy as np

from infc.runtime.engine.step import Chunk, build_step, pad_ranks


class Pages:
    """Pages per sequence, and for a plan with slot caches (a hybrid model's conv / recurrent
    state) a state slot per sequence, the lowest free one, held until release (as the engine's
    block manager does): sequences batched together never share a slot."""

    def __init__(self, num_pages: int, page_size: int):
        self.free = list(range(num_pages))[::-1]
        self.page_size = page_size
        self.of: dict[int, list[int]] = {}
        self.slots: dict[int, int] = {}

    def slot(self, seq: int, num_slots: int) -> int:
        if seq not in self.slots:
            used = set(self.slots.values())
            free = [s for s in range(num_slots) if s not in used]
            if not free:
                raise RuntimeError(f"all {num_slots} state slots are held (raise max_num_seqs)")
            self.slots[seq] = free[0]
        return self.slots[seq]

    def ensure(self, seq: int, tokens: int, shared: list[int] | None = None):
        pages = self.of.setdefault(seq, list(shared or []))
        while len(pages) * self.page_size < tokens:
            pages.append(self.free.pop())

    def release(self, seq: int, keep: int = 0):
        for p in self.of.pop(seq)[keep:]:
            self.free.append(p)
        self.slots.pop(seq, None)


def step(runner, pages: Pages, chunks: list[Chunk]) -> np.ndarray:
    for c in chunks:
        pages.ensure(c.seq_id, c.start + len(c.tokens))
    n = getattr(runner, "num_slots", 0)        # plans with slot caches: one slot per sequence
    meta = build_step(chunks, pages.of.__getitem__, pages.page_size,
                      slot_of=(lambda seq: pages.slot(seq, n)) if n else None)
    return runner.logits(meta).copy()


def rank_steps(pages: list[Pages], per_rank: list[list[Chunk]], spare: int) -> list:
    """Data-parallel ranks' steps: rank r's chunks over its own pages, every step padded alike
    (runtime/engine/step.py pad_ranks; pad rows write page `spare`, the runner's spare page)."""
    metas = []
    for p, chunks in zip(pages, per_rank):
        for c in chunks:
            p.ensure(c.seq_id, c.start + len(c.tokens))
        metas.append(build_step(chunks, p.of.__getitem__, p.page_size))
    return pad_ranks(metas, spare, pages[0].page_size)
