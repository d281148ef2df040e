"""The disk tier: one file a block under `directory`, LRU within `capacity` bytes.

A file is a 96-byte header and the block's bytes, written whole (to a temporary name, then
renamed) and read whole: one large sequential write or read each. The header holds a magic, the
namespace (what the block's bytes mean: the cache layout and the model, KVTiers makes it), the
block hash, the payload length and a blake2b digest of the payload and the header before it. A
read checks all of them: a file that is short, long, foreign or corrupted is a miss, never data,
and is deleted. One file a block (not an append log) keeps eviction a plain unlink and a bad
block confined to its own file.

Writes run on a thread of their own, so the engine's step loop never waits for the disk: `put`
keeps a copy of the block until its file is in place (a `get` meanwhile is served from it) and
waits only when PENDING blocks are already queued (the disk is slower than the blocks come). A
folder that refuses a write (full, gone) drops that block, counted; serving goes on.

The files live for the process's life: a store starts by removing the block files a previous
run left in its namespace's folder (their hashes name token prefixes, not the weights that
computed them, so nothing proves they belong to this model's checkpoint).
"""
import hashlib
import os
import queue
import struct
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np

MAGIC = b"INFCKV01"
HEADER = struct.Struct("<8s32s32sQ16s")        # magic, namespace, block hash, length, digest
SUFFIX = ".kvb"
PENDING = 64                                   # blocks queued for the writer before put waits


def _digest(head: bytes, payload) -> bytes:
    h = hashlib.blake2b(head, digest_size=16)
    h.update(payload)
    return h.digest()


class DiskStore:
    def __init__(self, directory, capacity: int, namespace: bytes, block_bytes: int):
        if len(namespace) != 32:
            raise ValueError("a disk store's namespace is 32 bytes")
        self.folder = Path(directory) / f"infc-kv-{namespace[:8].hex()}"
        self.folder.mkdir(parents=True, exist_ok=True)
        self.namespace, self.block_bytes = namespace, block_bytes
        self.file_bytes = HEADER.size + block_bytes
        self.max_files = capacity // self.file_bytes
        if self.max_files < 1:
            raise ValueError(f"the disk tier's size ({capacity} bytes) holds no block of "
                             f"{self.file_bytes} bytes")
        for stale in [*self.folder.glob("*" + SUFFIX), *self.folder.glob("*.tmp")]:
            stale.unlink(missing_ok=True)
        self.lru: OrderedDict[bytes, None] = OrderedDict()
        self.pending: dict[bytes, bytes] = {}   # blocks whose file is not in place yet
        self.lock = threading.Lock()            # lru and pending, between put/get and the writer
        self.queue: queue.Queue = queue.Queue(PENDING)
        self.writer: threading.Thread | None = None
        self.rejected = 0                       # files that failed their checks (deleted)
        self.write_errors = 0                   # blocks not stored: the folder refused them
        self.written = self.read_bytes = 0

    def path(self, h: bytes) -> Path:
        return self.folder / (h.hex() + SUFFIX)

    def __contains__(self, h: bytes) -> bool:
        return h in self.lru

    def __len__(self) -> int:
        return len(self.lru)

    def touch(self, h: bytes) -> bool:
        """Whether block h is here (now the most recently used)."""
        with self.lock:
            if h in self.lru:
                self.lru.move_to_end(h)
                return True
            return False

    def put(self, h: bytes, block: np.ndarray):
        """Store a block (uint8 [block_bytes]), written by the writer thread; the least recently
        used blocks go past capacity."""
        with self.lock:
            if h in self.lru:
                self.lru.move_to_end(h)
                return
            data = np.ascontiguousarray(block).tobytes()
            assert len(data) == self.block_bytes, (len(data), self.block_bytes)
            self.lru[h] = None
            self.pending[h] = data
            gone = []
            while len(self.lru) > self.max_files:
                old, _ = self.lru.popitem(last=False)
                if self.pending.pop(old, None) is None:      # a queued one: the writer drops it
                    gone.append(old)
        for old in gone:
            self.path(old).unlink(missing_ok=True)
        if self.writer is None:
            self.writer = threading.Thread(target=self._write_loop, name="infc-kv-disk", daemon=True)
            self.writer.start()
        self.queue.put((h, data))

    def _write_loop(self):
        while True:
            h, data = self.queue.get()
            try:
                self._write(h, data)
            finally:
                self.queue.task_done()

    def _write(self, h: bytes, data: bytes):
        with self.lock:
            mine = self.pending.get(h) is data
            gone = h not in self.lru
        if not mine:                            # evicted (or stored again) before its turn
            self._drop_file(h, gone)
            return
        head = HEADER.pack(MAGIC, self.namespace, h, len(data), bytes(16))[:-16]
        tmp = self.path(h).with_suffix(".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(head + _digest(head, data))
                f.write(data)
            os.replace(tmp, self.path(h))
        except OSError:                         # a full or vanished folder: the block is dropped,
            tmp.unlink(missing_ok=True)         # the server goes on (its tokens are recomputed)
            with self.lock:
                self.write_errors += 1
                if self.pending.get(h) is data:
                    del self.pending[h]
                    self.lru.pop(h, None)
                gone = h not in self.lru
            self._drop_file(h, gone)
            return
        with self.lock:
            if self.pending.get(h) is data:
                del self.pending[h]
                self.written += self.file_bytes
                return
            gone = h not in self.lru
        self._drop_file(h, gone)

    def _drop_file(self, h: bytes, gone: bool):
        """The writer is done with one queued copy of block h, which was not the index's: when
        the block is gone from the index its file goes too. A write that finds its block stored
        again meanwhile leaves its file to the later copy's turn, and that copy, evicted before
        its turn or refused by the folder, is the one that must remove it (only the writer
        creates files, in queue order, so the file removed here is never a newer one)."""
        if gone:
            self.path(h).unlink(missing_ok=True)

    def drain(self):
        """Wait until every queued block is written (tests, shutdown)."""
        if self.writer is not None:
            self.queue.join()

    def get(self, h: bytes, out: np.ndarray) -> bool:
        """Read block h into out (uint8 [block_bytes]); False (and the file deleted) when it is
        missing, short, long, foreign or corrupted."""
        with self.lock:
            if h not in self.lru:
                return False
            data = self.pending.get(h)
            if data is not None:                # not written yet: the copy it was given
                out[...] = np.frombuffer(data, np.uint8)
                self.lru.move_to_end(h)
                return True
        try:
            with open(self.path(h), "rb") as f:
                raw = f.read(self.file_bytes + 1)
        except OSError:
            raw = b""
        if self._valid(h, raw):
            out[...] = np.frombuffer(raw, np.uint8, self.block_bytes, HEADER.size)
            self.read_bytes += self.file_bytes
            with self.lock:
                if h in self.lru:
                    self.lru.move_to_end(h)
            return True
        self.rejected += 1
        self.discard(h)
        return False

    def _valid(self, h: bytes, raw: bytes) -> bool:
        if len(raw) != self.file_bytes:
            return False
        magic, ns, name, length, digest = HEADER.unpack_from(raw)
        if (magic, ns, name, length) != (MAGIC, self.namespace, h, self.block_bytes):
            return False
        body = memoryview(raw)[HEADER.size:]
        return _digest(raw[:HEADER.size - 16], body) == digest

    def discard(self, h: bytes):
        with self.lock:
            self.lru.pop(h, None)
            self.pending.pop(h, None)
        self.path(h).unlink(missing_ok=True)

    def check(self):
        """The index and the folder agree once the writer is done (tests)."""
        self.drain()
        on_disk = {p.name for p in self.folder.iterdir()}
        assert not self.pending, len(self.pending)
        assert on_disk == {self.path(h).name for h in self.lru}, (sorted(on_disk), len(self.lru))
