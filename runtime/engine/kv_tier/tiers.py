"""KVTiers: the host pool and the disk store behind the block manager's prefix cache.

The block manager calls `offer` when a hashed page's last reference goes (and, under
INFC_KV_SAVE_AT_COMPUTE, `computed` once a step that fills a block is issued), `reusing` when it
hands a page out, and at admission `find` (is this block in a tier?), `fetch` (pin its host
row, reading it from disk first) and `restore` (this fresh page gets it); the engine calls
`flush` before it launches a step and after each step. A flush issues the offered blocks'
device-to-host copies (each into a row the pool gives, spilling its least recently used block
to disk when it is full), then the restores' host-to-device copies, and makes the next step
wait for what it must: the restores, and a save whose page was handed out again since it was
offered. Everything else overlaps the steps (on the GPU: the runner's copy stream).

When a block is saved: ahead of its eviction by default (write-back, as SGLang's hierarchical
cache can): a released block stays dirty, on its page, until a flush finds its page among the
`ahead` pages at the front of the block manager's free queue (the pages the next steps'
allocations take first; infc/config.py KV_SAVE_AHEAD_STEPS steps' worth), or until its page is
handed out before that (then the step that writes the page waits for the save). The queue is in
release order, so a page's place in it is counted, not walked: each page entering it takes the
next ticket (the initial pages their ids), pages leave from the front in ticket order (`reusing`)
or from the middle (`taken`: a prefix hit; a hole), and a page's place is its ticket less the
front's and the holes before it. A block that is hit again, or never evicted, is never copied:
saves cost nothing while HBM has room (a prefix hit beside the saves of every finished request
took 8-10 % longer, bench/NOTES.md issue 44).
INFC_KV_SAVE_EAGER=1 saves at release; INFC_KV_SAVE_AT_COMPUTE=1 once, at the flush after the
step that computes the block (as vLLM's offloading connector stores them), and not again when its
sequence lets it go, even if the pool has dropped it since (saved at both, a pool smaller than the
run's blocks copied each block twice: 160 GB against 81 at qwen3-4b 1024/128 x 256 with 32 GiB).
The tiers of state snapshots (state_snapshots.py) offer a snapshot when it is evicted: no
write-back there (ahead 0).

Fences are the runner's (runtime/cuda/kv_copies.py: ordered ints, a copy stream is in order, so
waiting on the latest covers the earlier ones; None on the CPU, whose copies are done at once).
"""
import hashlib
import json
import time
from bisect import bisect_left
from collections import deque
from dataclasses import dataclass, field
from itertools import compress, repeat
from operator import is_

from infc import envs

from ..kv_events import MEDIUM_HOST
from ..metrics import Histogram
from .disk_store import DiskStore
from .host_pool import HostPool

GIB = 1 << 30
_RESTORE = [0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0]


@dataclass(frozen=True)
class OffloadConfig:
    """--kv-offloading-size (GiB of host memory; 0: no tiers), --kv-offloading-disk (a folder)
    and --kv-offloading-disk-size (GiB of it)."""
    host_gib: float = 0.0
    disk_dir: str | None = None
    disk_gib: float = 0.0

    @property
    def enabled(self) -> bool:
        return self.host_gib > 0


@dataclass
class TierStats:
    host_hit_tokens: int = 0        # admitted tokens whose blocks came from the host pool
    disk_hit_tokens: int = 0        # ... from the disk
    bytes_to_host: int = 0          # device -> host copies
    bytes_to_device: int = 0        # host -> device (restores)
    bytes_to_disk: int = 0
    bytes_from_disk: int = 0
    step_waits: int = 0             # steps made to wait (on the device) for a save or restore
    restore_seconds: Histogram = field(default_factory=lambda: Histogram(_RESTORE))


def _max(a, b):
    return b if a is None else a if b is None else max(a, b)


class KVTiers:
    def __init__(self, copies, config: OffloadConfig, namespace: bytes, page_size: int):
        self.copies, self.page_size = copies, page_size
        self.block_bytes = copies.block_bytes
        rows = int(config.host_gib * GIB) // self.block_bytes
        if rows < 1:
            raise ValueError(f"--kv-offloading-size {config.host_gib} GiB holds no KV block "
                             f"({self.block_bytes} bytes a block of {page_size} tokens)")
        self.slab = copies.make_slab(rows)
        self.pool = HostPool(rows)
        self.disk = None
        if config.disk_dir:
            if config.disk_gib <= 0:
                raise ValueError("--kv-offloading-disk needs --kv-offloading-disk-size > 0 (GiB)")
            self.disk = DiskStore(config.disk_dir, int(config.disk_gib * GIB), namespace, self.block_bytes)
        elif config.disk_gib:
            raise ValueError("--kv-offloading-disk-size needs --kv-offloading-disk (a folder)")
        self.saves: dict[bytes, int] = {}        # offered: hash -> page, copy not issued yet
        self.loads: list[tuple[bytes, int, int]] = []   # (hash, page, row), copy not issued yet
        self.page_fence: dict[int, object] = {}  # page -> the save copy reading it
        self.step_fence = None                   # the next step waits for the copies up to this
        self.freed: set[int] = set()             # pages freed since the last flush before a launch
        self.stats = TierStats()
        self._fetch_seconds = 0.0                # disk reads of the restores pending
        self._fetched = [0, 0]                   # the last fetch's blocks from host, from disk
        # KV events (kv_events.py): called with each block entering or leaving the host pool,
        # medium "CPU" (as vLLM's CPU offloading reports them: no tokens, no parent); None: off
        self.on_event = None
        self.at_compute = envs.value("INFC_KV_SAVE_AT_COMPUTE")
        # page -> the block saved from it when computed, while a sequence holds it (not saved
        # again at release); by page, so a page released without its hash (reset) forgets it too
        self.saved_at_compute: dict[int, bytes] = {}
        # write-back (write_back()): released blocks not copied yet, page -> hash, in ticket order
        # (its ticket in _ticket); each page holds its block until it is handed out again
        # (reusing), so the copy may come any time before. No tuple a page: a 32k prompt's release
        # is 2,048 pages, and objects the collector tracks trigger its collections
        self.ahead = 0
        self.dirty: dict[int, bytes] = {}
        self._ticket: dict[int, int] = {}        # page -> its place in the free queue's order
        self._next_ticket = 0
        self._front = 0                          # every page ticketed below this has left the queue
        self._holes: list[int] = []              # sorted tickets >= _front of pages taken from the middle

    @property
    def capacity_rows(self) -> int:
        return self.pool.num_rows

    def write_back(self, ahead: int, num_pages: int):
        """Save released blocks only once their pages are among the first `ahead` of the block
        manager's free queue (num_pages pages, initially in id order), unless INFC_KV_SAVE_EAGER
        or INFC_KV_SAVE_AT_COMPUTE asks for another timing."""
        if not (self.at_compute or envs.value("INFC_KV_SAVE_EAGER")):
            self.ahead = max(0, int(ahead))
            self._next_ticket = num_pages

    def _ticket_of(self, page: int) -> int:
        return self._ticket.get(page, page)      # a page never released: its id (the initial order)

    def _place(self, ticket: int) -> int:
        """At most how many free pages stand before the page with this ticket (exact unless pages
        went to the front: spec decoding's truncate; then it saves early, never late)."""
        return ticket - self._front - bisect_left(self._holes, ticket)

    # -- the block manager's hooks --------------------------------------------------------------
    def offer(self, h: bytes, page: int):
        """A hashed page lost its last reference: keep its block (copied at the next flush)."""
        if self.pool.get(h) is not None or h in self.saves:
            return
        if self.disk is not None and self.disk.touch(h):
            return
        self.saves[h] = page

    def computed(self, h: bytes, page: int):
        """A step filling block h on `page` has been issued (the page still held by the sequence
        computing it): under INFC_KV_SAVE_AT_COMPUTE, copy it out at the next flush, after that
        step on the stream."""
        if self.at_compute:
            self.offer(h, page)
            self.saved_at_compute[page] = h

    def released(self, pages: list[int], hashes: list):
        """Pages lost their last reference, in the order they joined the free queue, with their
        blocks' hashes (None: no block). A hashed block is offered, unless it was saved when
        computed (then it is only marked recently used, where the pool still has it); under
        write-back it stays dirty. One call a sequence's release: the per-page calls and their
        objects were most of a prefix hit's host time with the tier on (bench/NOTES.md, issue 44)."""
        self.freed.update(pages)
        if self.ahead:                           # write-back (write_back() leaves at-compute saves off)
            # every page, hashed or not, joins the queue's tail; each hashed page is dirty (a page
            # being released was held, so not dirty: taken and reusing take it out). In C loops: a
            # hit's release is thousands of pages, a partial last block at most a few
            first = self._next_ticket
            self._ticket.update(zip(pages, range(first, first + len(pages))))
            self._next_ticket += len(pages)
            self.dirty.update(zip(pages, hashes))
            if None in hashes:
                deque(map(self.dirty.pop, compress(pages, map(is_, hashes, repeat(None)))), 0)
            return
        at_compute = self.saved_at_compute
        for page, h in zip(pages, hashes):
            saved = at_compute.pop(page, None) if at_compute else None
            if h is None:
                continue
            if saved == h:
                self.pool.get(h)
            else:
                self.offer(h, page)

    def reusing(self, page: int):
        """A page is handed out again: the step that writes it waits for a save still reading it
        (or, a dirty block, for the save issued now: before the step, at the flush)."""
        if self.ahead:                           # from the free queue's front
            self._front = max(self._front, self._ticket_of(page) + 1)
            del self._holes[:bisect_left(self._holes, self._front)]
            h = self.dirty.pop(page, None)
            if h is not None:
                self.offer(h, page)
        f = self.page_fence.pop(page, None)
        if f is not None:
            self.step_fence = _max(self.step_fence, f)

    def taken(self, pages: list, queue):
        """Free pages were taken from the middle of the queue (a prefix hit on their blocks):
        holes in the queue's order; a dirty block among them is dirty again when released.
        queue: the free queue without them (the block manager's), renumbered once the holes
        outnumber it."""
        if not self.ahead:
            return
        new = sorted(map(self._ticket.get, pages, pages))      # _ticket_of, in a C loop
        if new and new[0] < self._front:
            new = new[bisect_left(new, self._front):]
        holes = self._holes
        if new and holes and new[0] < holes[-1]:
            holes += new
            holes.sort()                         # two sorted runs: merged in linear time
        else:
            holes += new
        deque(map(self.dirty.pop, pages, repeat(None)), 0)
        if len(holes) > len(queue):
            self._renumber(queue)

    def _renumber(self, queue):
        """Tickets from the free queue's order as it stands: no holes, every place exact. A hit's
        pages leave holes that only the front's passing clears, while their release tickets them
        anew at the tail: an 8k prefix hit on qwen3-4b left 512 more every hit, without bound."""
        self._ticket = dict(zip(queue, range(len(queue))))
        self._front, self._next_ticket, self._holes = 0, len(queue), []

    def find(self, h: bytes) -> bool:
        return h in self.pool or h in self.saves or (self.disk is not None and h in self.disk)

    def fetch(self, hashes: list[bytes], hits: list) -> list[int]:
        """Pin the host rows of the tier blocks among hits (None entries, whose hashes are at the
        same index of hashes), reading disk blocks into the pool; hits is cut at the first that
        cannot be had (a corrupt or vanished file, no row to read it into). The pinned rows, in
        order: restore or unfetch each."""
        rows = []
        self._fetched = [0, 0]                   # host, disk
        t0 = time.perf_counter()
        for i, page in enumerate(hits):
            if page is not None:
                continue
            row = self._fetch_one(hashes[i])
            if row is None:
                del hits[i:]
                break
            self.pool.pin(row)
            rows.append(row)
        self._fetch_seconds += time.perf_counter() - t0
        return rows

    def _fetch_one(self, h: bytes) -> int | None:
        if h in self.saves:                      # offered, evicted before its copy: copy it now
            self._issue_saves({h: self.saves.pop(h)}, always_wait=True)
        row = self.pool.get(h)
        if row is not None or self.disk is None or h not in self.disk:
            self._fetched[0] += row is not None
            return row
        row = self._free_row()
        if row is None:
            return None
        self.copies.host_wait(self.pool.fence[row])      # a restore may still read the row
        if not self.disk.get(h, self.slab[row]):
            self.pool.release(row)
            return None
        self.stats.bytes_from_disk += self.block_bytes
        self._pool_add(h, row)
        self._fetched[1] += 1
        return row

    def unfetch(self, rows: list[int]):
        """An admission that fetched rows did not go through."""
        for row in rows:
            self.pool.unpin(row)

    def restore(self, h: bytes, page: int, row: int):
        self.loads.append((h, page, row))

    def admitted(self):
        """The admission that fetched last went through: its blocks are hits, by tier."""
        host, disk = self._fetched
        self.stats.host_hit_tokens += host * self.page_size
        self.stats.disk_hit_tokens += disk * self.page_size

    # -- copies ---------------------------------------------------------------------------------
    def _free_row(self) -> int | None:
        """A row to fill: a free one, else the least recently used unpinned block's, spilled to
        disk first when there is one. None: every row is pinned."""
        if self.pool.free:
            return self.pool.free.pop()
        victim = self.pool.victim()
        if victim is None:
            return None
        h, row = victim
        self._pool_drop(h)
        self._spill(h, row)
        return row

    def _pool_add(self, h: bytes, row: int):
        self.pool.add(h, row)
        if self.on_event is not None:
            self.on_event(("stored", [h], None, [], None, MEDIUM_HOST))

    def _pool_drop(self, h: bytes):
        self.pool.drop(h)
        if self.on_event is not None:
            self.on_event(("removed", [h], MEDIUM_HOST))

    def _spill(self, h: bytes, row: int):
        """Block h leaves the pool from `row`: to the disk, when there is one."""
        if self.disk is not None and h not in self.disk:
            self.copies.host_wait(self.pool.fence[row])  # its save may still be in flight
            self.disk.put(h, self.slab[row])
            self.stats.bytes_to_disk += self.block_bytes

    def _issue_saves(self, saves: dict, blocks=None, always_wait: bool = False):
        """Copy offered blocks into rows. A row being filled is pinned until its copy is issued
        (spilling it would write what it held before); a pool smaller than the batch takes it
        in chunks, each evicting the one before."""
        hashes, pages, rows = [], [], []
        # by page: consecutive pages take consecutive rows where free rows run on, so the GPU
        # copies them (and later restores them) as one run a (cache, layer)
        for h, page in sorted(saves.items(), key=lambda kv: kv[1]):
            if h in self.pool:
                continue
            row = self._free_row()
            if row is None and pages:
                self._copy_out(hashes, pages, rows, blocks, always_wait)
                hashes, pages, rows = [], [], []
                row = self._free_row()
            if row is None:                      # every row pinned by restores: not kept
                break
            self._pool_add(h, row)
            self.pool.pin(row)
            hashes.append(h)
            pages.append(page)
            rows.append(row)
        if pages:
            self._copy_out(hashes, pages, rows, blocks, always_wait)

    def _copy_out(self, hashes, pages, rows, blocks, always_wait: bool):
        fence = self.copies.save(pages, rows)
        self.stats.bytes_to_host += len(pages) * self.block_bytes
        for h, page, row in zip(hashes, pages, rows):
            self.pool.unpin(row)
            self.pool.fence[row] = fence
            if fence is not None:
                self.page_fence[page] = fence
            # the page no longer holds h (handed out again since it was offered): the step about
            # to write it waits. A page still holding h (its sequence runs on, or a prefix hit took
            # it) is only read by the steps: the save runs beside them.
            if always_wait or (blocks is not None and blocks[page].hash != h):
                self.step_fence = _max(self.step_fence, fence)

    def flush(self, blocks, before_launch: bool = False):
        """Issue the pending saves (under write-back, first the dirty blocks now among the first
        `ahead` pages of the free queue), then the pending restores (blocks: the block manager's,
        to skip a restore whose page was freed and handed out again meanwhile); the next step
        waits for what it reads or overwrites.

        Restores overlap the step in flight unless one writes a page freed since the last flush
        before a launch (a sequence that ended while that step ran may still be in it); the
        engine's flush before a launch (before_launch) starts the count again. Saves always wait
        for the steps issued before them (their blocks may be that step's output)."""
        while self.dirty:
            page, h = next(iter(self.dirty.items()))
            if self._place(self._ticket[page]) >= self.ahead:
                break
            del self.dirty[page]
            self.offer(h, page)
        if self.saves:
            saves, self.saves = self.saves, {}
            self._issue_saves(saves, blocks)
        if self.loads:
            t0 = time.perf_counter()
            loads, self.loads = self.loads, []
            live = sorted((row, page) for h, page, row in loads if blocks[page].hash == h)
            live = [(page, row) for row, page in live]                  # by row: runs stay runs
            if live:
                pages = [p for p, _ in live]
                fence = self.copies.load(pages, [r for _, r in live],
                                         any(p in self.freed for p in pages))
                self.stats.bytes_to_device += len(live) * self.block_bytes
                for _, row in live:
                    self.pool.fence[row] = fence
                self.step_fence = _max(self.step_fence, fence)
            for _, _, row in loads:
                self.pool.unpin(row)
            self.stats.restore_seconds.observe(self._fetch_seconds + time.perf_counter() - t0)
            self._fetch_seconds = 0.0
        if self.step_fence is not None:
            self.copies.step_waits(self.step_fence)
            self.stats.step_waits += 1
            self.step_fence = None
        if before_launch:
            self.freed.clear()

    # -- benchmarks: where the next hit comes from ------------------------------------------------
    def demote(self, bm, to_disk: bool = False):
        """Every block cached in bm's pages that no sequence holds leaves them for the host pool
        (to_disk: and every block of the pool for the disk), as eviction would move them: the
        next prefix hit comes from that tier (`infc bench prefix --tier`)."""
        for page in bm.free:
            b = bm.blocks[page]
            self.dirty.pop(page, None)
            if b.hash is not None:
                self.offer(b.hash, page)
                del bm.cached[b.hash]
                if bm.events is not None:        # gone from the device's cache (KV events)
                    bm.record_removed(b.hash)
                b.hash = None
        self.flush(bm.blocks)
        if to_disk:
            if self.disk is None:
                raise ValueError("no disk tier to demote to (--kv-offloading-disk)")
            while (victim := self.pool.victim()) is not None:
                h, row = victim
                self._pool_drop(h)
                self._spill(h, row)
                self.pool.release(row)

    def check_places(self, free_queue) -> int:
        """Write-back's counting (tests): every dirty page is free, and its counted place is at most
        its place in the queue (never saved late), exactly it without pages sent to the front.
        Returns how many are counted early (before their place)."""
        places = {page: i for i, page in enumerate(free_queue)}
        tickets = [self._ticket[page] for page in self.dirty]
        assert tickets == sorted(tickets), "dirty blocks out of ticket order"
        early = 0
        for page in self.dirty:
            t = self._ticket[page]
            assert page in places, f"dirty page {page} is not free"
            assert self._place(t) <= places[page], (page, self._place(t), places[page])
            early += self._place(t) < places[page]
        return early

    def check(self):
        """Accounting (tests): rows, pins and files agree; nothing pending between steps but
        saves (offered blocks whose copy waits for the next flush) and dirty blocks."""
        self.pool.check()
        assert not self.loads and not self.pool.pins, (self.loads, self.pool.pins)
        if self.disk is not None:
            self.disk.check()


def namespace(runner, block_bytes: int) -> bytes:
    """What a stored block's bytes mean: the plan's caches (their layout and dtype), the page size,
    the block's bytes and the model's name."""
    plan = getattr(runner, "plan", None) or {}
    key = json.dumps([plan.get("caches"), plan.get("model"), runner.page_size, block_bytes],
                     sort_keys=True, default=str)
    return hashlib.sha256(key.encode()).digest()


def for_engine(runner, config: OffloadConfig | None, prefix_caching: bool, dp: int, log=None):
    """The engine's tiers for these settings, or None (off, or not for this model: a note)."""
    if config is None or not config.enabled:
        return None
    if dp > 1:
        raise ValueError("--kv-offloading-size: KV tiers with data-parallel ranks are not "
                         "supported yet (each rank would need its own); run without it")
    if not prefix_caching:
        if log:
            log("  KV offloading off: it keeps prefix-cache blocks, and prefix caching is off "
                "(for this model, or by --no-enable-prefix-caching)")
        return None
    make = getattr(runner, "kv_copies", None)
    if make is None:
        raise ValueError(f"--kv-offloading-size: this runner ({type(runner).__name__}) cannot "
                         "copy KV pages to the host")
    copies = make()
    tiers = KVTiers(copies, config, namespace(runner, copies.block_bytes), runner.page_size)
    if log:
        disk = f", disk {config.disk_gib:g} GiB in {config.disk_dir}" if tiers.disk else ""
        mode = getattr(copies, "mode", None)        # the GPU's: a kernel a batch, or 2D copies
        how = f"; copies: {mode}" if mode else ""
        log(f"  KV offloading: host {tiers.capacity_rows} blocks ({config.host_gib:g} GiB){disk}{how}")
    return tiers
