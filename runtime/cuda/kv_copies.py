"""The CUDA runner's side of the KV tiers (runtime/engine/kv_tier/): device pages to and from rows
of a pinned host slab, on a copy stream of their own so the steps do not wait for them.

A batch of copies (a flush's saves, or its restores) first waits, on the device, for everything
issued on the main stream so far (the steps that wrote the pages, or still read a page being
restored over; restores skip that wait when KVTiers knows no step in flight has their pages, and
then overlap the step in flight), then moves every (paged cache, layer, page) block of the batch,
then records its fence: a number whose event, in a ring, is recorded after the batch. The copy
stream is in order, so waiting on a later record of a ring event covers every earlier batch:
step_waits makes the main stream wait (on the device) and host_wait the host, for the batch
`fence` and all before it.

How a batch moves, by what the artifact has:
- the plan's block_copy kernel (plan["block_copy"], a build for the host tier: compiler/codegen/
  render.py): the slab is mapped into the device's address space, the (page, row) pairs are
  written into a page-locked ring slot and uploaded, and one launch copies every block
  (codegen_templates/triton/block_copy.py.j2, its region table made once here). A few driver calls
  a batch, however many layers and runs: the engine thread launches steps, and a flush of
  qwen3-4b's 72 regions took 72 2D copies a run of pages (about 5 % of 256-concurrent throughput).
  Saves go through device memory (INFC_KV_SAVE_STAGING_BYTES, 256 MiB, in chunks of that many
  blocks): the kernel gathers the pages into the staging buffer at HBM speed and the copy engine
  moves each run of consecutive rows to the slab. Written straight into the mapped slab, a save
  held up to 64 SMs for the whole PCIe transfer (~170 MB a finished qwen3-4b sequence at 1024/128),
  and the steps beside it ran 8-18 % longer (bench/NOTES.md, "the host tier's cost on the engine
  thread"). The gathers run on a stream of their own into the two halves of the staging buffer in
  turn, and the copy stream moves each half out once its gather is done: with kernel -> copy ->
  kernel chained on the copy stream, an HBM prefix hit's step beside a 32k save reached the GPU
  2.4 ms late (+2.7 ms TTFT); split so, 0.02 ms (bench/NOTES.md, issue 44, the tier probe's
  `split`). Restores still read the mapped slab: they are few, and wait on the step after them.
- otherwise one 2D copy per paged (cache, layer) and run of consecutive pages and rows
  (compiler/contract/caches.py DeviceCaches.block_copies): the copy engines, no kernel.
"""
import numpy as np

from infc import envs
from infc.compiler.contract.bind import Resolver, dim_slots, grid
from .block_copy_args import pairs, region_table, row_runs
from .driver import launch

RING = 16


class DeviceCopies:
    def __init__(self, ctx, device_caches, kernel=None):
        """kernel: the plan's block_copy kernel (a KernelFn), or None: the driver's 2D copies
        (also when its word does not divide this storage's regions)."""
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
        self.kernel = None
        if kernel is not None:
            word, vec = kernel.meta["word"], kernel.meta["constexprs"]["VEC"]
            table = region_table(device_caches.layout, word, vec)
            if table is not None:
                self.kernel, self.word, self.num_regions = kernel, word, len(table)
                ctx.ensure_current()
                self._regions = ctx.alloc(table.nbytes)
                ctx.htod(self._regions, table)
                ctx.sync()                               # the table is uploaded before any batch
                # a batch's pages are distinct pages of this storage: at most this many pairs
                self.max_pairs = device_caches.num_pages + 1
                self._pairs = ctx.alloc(self.max_pairs * 8)
                self._ring = [None] * RING               # page-locked pairs, made on first use
                self._args: dict[str, tuple] = {}
                staging = envs.value("INFC_KV_SAVE_STAGING_BYTES")
                self.save_programs = envs.value("INFC_KV_SAVE_PROGRAMS")
                self.chained = envs.value("INFC_KV_SAVE_CHAINED")
                self.stage_rows = min(self.max_pairs, staging // self.block_bytes)
                self._stage = ctx.alloc(self.stage_rows * self.block_bytes) if self.stage_rows else None
                if self.stage_rows:
                    # the saves' own stream, pairs table (restores upload theirs on the copy
                    # stream meanwhile) and, a staging part (INFC_KV_SAVE_HALVES of them, 2 by
                    # default: halves), events: gathered / copied out
                    self.gather_stream = self.stream if self.chained else ctx.new_stream()
                    self._save_pairs = ctx.alloc(self.max_pairs * 8)
                    self.halves = max(1, min(envs.value("INFC_KV_SAVE_HALVES"), self.stage_rows))
                    self._gathered = [ctx.event() for _ in range(self.halves)]
                    self._copied = [ctx.event() for _ in range(self.halves)]
                    for e in self._copied:               # every part free at the start
                        e.record(self.stream)

    @property
    def mode(self) -> str:
        """How a batch moves (the engine's startup note)."""
        if self.kernel is None:
            return "2D copies a (cache, layer) and run"
        if not self.stage_rows:
            return "one kernel a batch"
        return (f"one kernel a batch; saves through {self.stage_rows * self.block_bytes >> 20} MiB "
                "of device staging and the copy engine")

    def make_slab(self, rows: int) -> np.ndarray:
        self.ctx.ensure_current()
        n = rows * self.block_bytes
        # the kernel reads and writes the slab where it is: mapped into the device's address space
        self._pinned = self.ctx.pinned(n, mapped=True) if self.kernel is not None else self.ctx.pinned(n)
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
        fence, self.issued = self.issued, self.issued + 1
        # a batch names distinct pages, so it fits the kernel's pair table (one that does not, a
        # page offered twice between flushes, is not seen from KVTiers; the 2D copies take it)
        if self.kernel is not None and 0 < len(pages) <= self.max_pairs:
            self._launch(fence, pages, rows, to_host)
        else:
            for dev, at, width, n, pitch in self.caches.block_copies(pages, rows, self.block_bytes):
                if to_host:
                    ctx.copy2d(host + at, self.block_bytes, dev, pitch, width, n, True, self.stream)
                else:
                    ctx.copy2d(dev, pitch, host + at, self.block_bytes, width, n, False, self.stream)
        end.record(self.stream)
        self.timed.add(to_host)
        self.events[fence % RING].record(self.stream)
        return fence

    def _launch(self, fence: int, pages, rows, to_host: bool):
        """The batch's pairs into ring slot fence % RING (once the batch that used it last, RING
        before, is done: its upload read it), uploaded, and one block_copy launch (a save through
        staging: one a chunk)."""
        ctx, slot = self.ctx, fence % RING
        if self._ring[slot] is None:
            self._ring[slot] = ctx.pinned(self.max_pairs * 8)
        elif fence >= RING:
            self.events[slot].wait()
        staged = self._ring[slot].view(np.int32).reshape(-1, 2)
        if to_host and self.stage_rows:
            return self._staged(staged, pages, rows)
        n = pairs(pages, rows, staged)
        ctx.htod_raw(self._pairs, staged.ctypes.data, n * 8, self.stream)
        self._gather("save" if to_host else "load", self._pairs, n)

    def _staged(self, staged, pages, rows):
        """A save in chunks of half the staging buffer (a part of it: INFC_KV_SAVE_HALVES), the
        halves in turn: on the gather stream, chunk block k into its half's block k (one launch,
        once the copies out of that half's last chunk are done); on the copy stream, once the gather
        is done, each run of consecutive rows to the slab (the copy engine). Neither stream holds a
        kernel waiting on a copy of its own. One part: each gather waits for the copy before it."""
        # G: the gathers' stream; the copy stream itself under INFC_KV_SAVE_CHAINED (the A/B)
        ctx, bb, G = self.ctx, self.block_bytes, self.gather_stream
        halves = self.halves
        half = self.stage_rows // halves
        ctx.wait_event(self.mark, G)                    # the steps that wrote the pages
        i = np.arange(len(pages))
        n = pairs(pages, i % half + (i // half) % halves * half, staged)
        ctx.htod_raw(self._save_pairs, staged.ctypes.data, n * 8, G)
        host = self.slab.ctypes.data
        for c, at in enumerate(range(0, n, half)):
            m, h = min(half, n - at), c % halves
            ctx.wait_event(self._copied[h], G)
            self._gather("stage", self._save_pairs + at * 8, m, stream=G)
            self._gathered[h].record(G)
            ctx.wait_event(self._gathered[h], self.stream)
            for k, row, count in row_runs(rows[at:at + m]):
                ctx.dtoh_raw(host + row * bb, self._stage + (h * half + k) * bb, count * bb, self.stream)
            self._copied[h].record(self.stream)

    def _gather(self, key: str, pairs_ptr: int, n: int, stream=None):
        """One block_copy launch over n pairs at pairs_ptr, on `stream` (default: the copy stream)."""
        args, n_slot, p_slot = self._packed(key)
        k, items = self.kernel, n * self.num_regions
        args.set(n_slot, items)
        args.set(p_slot, pairs_ptr)
        g = grid(k.meta, {"N": items})
        if key != "load" and self.save_programs:    # the programs loop over the items: any grid holds
            g = (min(items, self.save_programs), 1, 1)
        launch(self.ctx, k.fn, g, k.block, k.shared, args, stream=self.stream if stream is None else stream)

    def _packed(self, key: str):
        """The kernel's arguments for saves, loads or gathers into staging ("stage"), packed once;
        the item count and the pairs' address are set per launch."""
        if key not in self._args:
            k = self.kernel
            host = self._stage if key == "stage" else self.ctx.device_ptr(self._pinned)
            named = {"dev": self.caches.base, "host": host, "pairs": self._pairs,
                     "regions": self._regions, "n_regions": self.num_regions,
                     "row_words": self.block_bytes // self.word, "to_host": int(key != "load")}
            values = Resolver(arg=named.__getitem__, dim=lambda d: 0).values(k.meta, kernel=k.id)
            slot = next(i for i, d in dim_slots(k.meta) if d == "N")
            pairs_slot = next(i for i, (_, _, src) in enumerate(k.meta["params"]) if src == "arg:pairs")
            self._args[key] = (k.pack(values), slot, pairs_slot)
        return self._args[key]

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
        self.ctx.ensure_current()
        self.host_wait(self.issued - 1 if self.issued else None)
        if self.slab is not None:
            self.ctx.free_pinned(self._pinned)
            self.slab = self._pinned = None
        if self.kernel is not None:
            for staged in self._ring:
                if staged is not None:
                    self.ctx.free_pinned(staged)
            self.ctx.free(self._regions)
            self.ctx.free(self._pairs)
            if self._stage is not None:
                self.ctx.free(self._stage)
                self.ctx.free(self._save_pairs)
                self._stage = None
            self.kernel, self._ring = None, [None] * RING
