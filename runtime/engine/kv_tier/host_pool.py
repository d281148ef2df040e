"""The host tier's rows: one slab of `rows` blocks (the runner's: pinned on the GPU), each row free
or holding one block hash, in LRU order. A row with a restore pending (its copy not issued yet)
is pinned: never evicted or rewritten until the flush has issued that copy."""
from collections import OrderedDict


class HostPool:
    def __init__(self, rows: int):
        if rows < 1:
            raise ValueError(f"a host pool needs at least one row, got {rows}")
        self.num_rows = rows
        self.lru: OrderedDict[bytes, int] = OrderedDict()      # hash -> row, least recent first
        self.free: list[int] = list(range(rows - 1, -1, -1))    # pop() gives row 0 first
        self.pins: dict[int, int] = {}                          # row -> pending restores
        self.fence: list = [None] * rows                        # the last copy issued on the row

    def __contains__(self, h: bytes) -> bool:
        return h in self.lru

    def __len__(self) -> int:
        return len(self.lru)

    def get(self, h: bytes) -> int | None:
        """The row holding h (now the most recently used), or None."""
        row = self.lru.get(h)
        if row is not None:
            self.lru.move_to_end(h)
        return row

    def add(self, h: bytes, row: int):
        assert h not in self.lru, "a block is in the pool once"
        self.lru[h] = row

    def victim(self) -> tuple[bytes, int] | None:
        """The least recently used unpinned block (hash, row), left in place; None if every row
        is pinned."""
        for h, row in self.lru.items():
            if row not in self.pins:
                return h, row
        return None

    def drop(self, h: bytes) -> int:
        """Take h out; its row is the caller's (to refill, or to give back with `release`)."""
        return self.lru.pop(h)

    def release(self, row: int):
        self.free.append(row)

    def pin(self, row: int):
        self.pins[row] = self.pins.get(row, 0) + 1

    def unpin(self, row: int):
        n = self.pins[row] - 1
        if n:
            self.pins[row] = n
        else:
            del self.pins[row]

    def check(self):
        """Every row is free or holds exactly one block (tests)."""
        held = list(self.lru.values())
        assert len(set(held)) == len(held), "a row holds two blocks"
        assert not set(held) & set(self.free), "a row is both free and held"
        assert len(held) + len(self.free) == self.num_rows, (len(held), len(self.free), self.num_rows)
        assert set(self.pins) <= set(held), "a pinned row holds no block"
