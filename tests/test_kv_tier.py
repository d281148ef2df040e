"""KV tiers (runtime/engine/kv_tier/, issue 44): blocks that leave the device's pages go to a host
pool and on to a disk folder, and come back bit-identical when a prompt's prefix is found there.

Blocks round-trip byte for byte (numpy pages, device pages through the fake CUDA driver, disk
files); a truncated, corrupted or foreign file is a miss and is deleted. Under memory pressure,
outputs with the tiers on equal outputs with them off (FakeRunner, whose outputs hash the whole
context read back through the block tables, so a wrong restore changes them; and the tiny real
model) while the metrics show host and disk hits; 1,000 aborts leave nothing held."""
import os
import threading

import numpy as np
import pytest

from infc.compiler.contract import caches as C
from infc.runtime.engine.kv_tier.disk_store import HEADER, DiskStore
from infc.runtime.engine.kv_tier.host_copies import HostCopies
from infc.runtime.engine.kv_tier.tiers import GIB, OffloadConfig
from infc.runtime.engine.runner import CPURunner
from infc.runtime.engine.sampling import SamplingParams

from exhaustive import EXHAUSTIVE
from fake_cuda import FakeContext
from test_scheduler import FakeRunner, assert_all_free, drain, make_engine, tiny_plan  # noqa: F401

GREEDY = dict(temperature=0, ignore_eos=True)
DECL = {
    "k": {"kind": "paged", "shape": [2, 8], "dtype": "bf16", "layers": [0, 1, 3]},
    "v": {"kind": "paged", "shape": [3, 4], "dtype": "bf16", "layers": [0, 1, 3]},
    "conv": {"kind": "slot", "shape": [3, 5], "dtype": "f32", "layers": [2]},
}
PS = 4


def _random_host(num_pages=10, seed=0):
    host = C.HostCaches(DECL, PS, num_pages, 2)
    rng = np.random.default_rng(seed)
    for a in host.arrays.values():
        a[...] = rng.standard_normal(a.shape)
    return host


# -- blocks round-trip -------------------------------------------------------------------------
def test_host_blocks_restore_numpy_pages_bit_identical():
    host = _random_host()
    before = {k: a.copy() for k, a in host.arrays.items()}
    copies = HostCopies(host)
    assert copies.block_bytes == C.page_bytes(DECL, PS, itemsize=4)
    slab = copies.make_slab(6)
    copies.save([7, 2, 3], [4, 0, 1])
    for (name, _), a in host.arrays.items():            # the pages reused for something else
        if name != "conv":
            a[[7, 2, 3]] = -1.0
    copies.load([1, 5, 6], [4, 0, 1])                   # restored to other pages
    for (name, layer), a in host.arrays.items():
        b = before[(name, layer)]
        if name == "conv":
            assert (a == b).all()                       # slot caches are not part of a block
            continue
        for src, dst in ((7, 1), (2, 5), (3, 6)):
            assert a[dst].tobytes() == b[src].tobytes(), (name, layer, src)
    assert slab[[2, 3, 5]].sum() == 0                   # rows not named are untouched


@pytest.mark.parametrize("kernel,staged,chained,halves", [(False, 0, 0, 2), (True, 0, 0, 2), (True, 1, 0, 2),
                                                          (True, 2, 0, 2), (True, 4, 0, 2), (True, 4, 1, 2),
                                                          (True, 4, 0, 1), (True, 4, 0, 3)])
def test_device_blocks_move_the_same_bytes_as_host_blocks(fake_driver, kernel, staged, chained, halves, monkeypatch):
    """The CUDA runner's copies over fake memory, on the copy stream: 2D copies per region and
    run, or (kernel) the plan's block_copy kernel, run by the interpreter, on the mapped slab;
    staged: saves gathered into a device buffer of that many blocks, then copied out a run of
    rows at a time."""
    from infc.compiler.codegen.render import render_block_copy
    from infc.runtime.cuda.artifact import KernelFn
    from infc.runtime.cuda import kv_copies
    from infc.runtime.cuda.kv_copies import DeviceCopies
    monkeypatch.setattr(kv_copies, "RING", 3)           # a short ring: its slots are reused below
    ctx = fake_driver.Context()
    dev = C.DeviceCaches(ctx, DECL, PS, num_pages=10, num_slots=2)
    host = C.HostCaches(DECL, PS, 10, 2, factory=lambda shape, d: np.zeros(shape, np.uint16 if d == "bf16" else np.float32))
    rng = np.random.default_rng(3)
    for (name, layer), a in host.arrays.items():
        a.view(np.uint8)[...] = rng.integers(0, 256, a.view(np.uint8).shape, dtype=np.uint8)
        ptr, n = dev.region(name, layer)
        ctx.view(ptr, n)[:] = a.reshape(-1).view(np.uint8)
    k = None
    if kernel:
        src = render_block_copy({"caches": DECL}, PS)
        k = KernelFn(src.id, src.meta, {"num_warps": 4, "hidden_args": 2},
                     fake_driver.Module(src.source.encode()).function(src.meta["entry"]))
    monkeypatch.setenv("INFC_KV_SAVE_STAGING_BYTES", str(staged * C.page_bytes(DECL, PS)))
    monkeypatch.setenv("INFC_KV_SAVE_CHAINED", str(chained))   # the gathers on the copy stream
    monkeypatch.setenv("INFC_KV_SAVE_HALVES", str(halves))     # the staging buffer's parts
    copies = DeviceCopies(ctx, dev, k)
    assert copies.block_bytes == host.block_bytes == C.page_bytes(DECL, PS)
    assert (copies.kernel is not None) == kernel
    assert (copies.stage_rows if kernel else 0) == staged
    if staged:                                           # chained: no stream of the gathers' own
        assert (copies.gather_stream is copies.stream) == bool(chained)
    slab = copies.make_slab(8)
    pages, rows = [3, 4, 5, 9, 0], [2, 3, 4, 7, 0]     # a run of three, then single pages
    ctx.num_copies, launched = 0, len(fake_driver.launches)
    f = copies.save(pages, rows)
    # 3 runs, 6 paged regions; or the pairs' upload and one launch; staged in chunks of a part of
    # the staging buffer (4 in halves: rows [2, 3], [4, 7], [0]; 4 whole: [2, 3, 4, 7], [0]; 4 in
    # 3 parts of 1; 2 and 1: a block a chunk): the upload, a launch a chunk and a copy a run of rows in it
    want_calls = ({4: {2: (1 + 4, 3), 1: (1 + 3, 2), 3: (1 + 5, 5)}[halves], 2: (1 + 5, 5), 1: (1 + 5, 5)}[staged]
                  if staged else (1, 1) if kernel else (3 * 6, 0))
    if staged:
        assert copies.halves == min(halves, staged) and len(copies._copied) == copies.halves
    assert (ctx.num_copies, len(fake_driver.launches) - launched) == want_calls
    want = np.zeros_like(slab)
    host.read_pages(pages, want, rows)
    assert slab.tobytes() == want.tobytes()
    copies.host_wait(f)
    copies.step_waits(f)
    ctx.memset(dev.base, dev.nbytes, 0)                 # the device pages are gone
    for _ in range(4 if kernel else 0):                 # round the ring of pair tables
        copies.load([1], [5])
    copies.load([1, 2, 6, 8, 7], rows)
    host.write_pages([1, 2, 6, 8, 7], want, rows)
    for name, layer in host.arrays:
        if DECL[name]["kind"] == "paged":
            ptr, n = dev.region(name, layer)
            got = np.frombuffer(ctx.read(ptr, n), np.uint8).reshape(11, -1)
            exp = host.get(name, layer).reshape(11, -1).view(np.uint8)
            for p in (1, 2, 6, 8, 7):
                assert got[p].tobytes() == exp[p].tobytes(), (name, layer, p)
    copies.close()
    assert not ctx.pinned_live and not ctx._mapped and ctx.allocated() == dev.nbytes


def _disk(tmp_path, files=4, block_bytes=1000, ns=b"n" * 32):
    return DiskStore(tmp_path, files * (block_bytes + HEADER.size), ns, block_bytes)


def test_disk_blocks_round_trip_and_lru(tmp_path):
    d = _disk(tmp_path)
    rng = np.random.default_rng(0)
    blocks = {bytes([i]) * 32: rng.integers(0, 256, 1000, dtype=np.uint8) for i in range(6)}
    for h, b in blocks.items():
        d.put(h, b)
    assert len(d) == 4 and bytes([0]) * 32 not in d and bytes([1]) * 32 not in d   # LRU out
    out = np.zeros(1000, np.uint8)
    for h in list(blocks)[2:]:                  # from the writer's queue or the file, as it goes
        assert d.get(h, out) and out.tobytes() == blocks[h].tobytes()
    d.check()                                   # drained: the files are the index's, no others
    before = d.read_bytes                       # the first reads raced the writer: queue or file
    for h in list(blocks)[2:]:                  # from the files
        out[:] = 0
        assert d.get(h, out) and out.tobytes() == blocks[h].tobytes()
    assert d.read_bytes - before == 4 * (1000 + HEADER.size)
    assert not d.get(bytes([0]) * 32, out)


@pytest.mark.parametrize("damage", ["truncate", "flip", "extend", "foreign", "renamed"])
def test_a_damaged_disk_block_is_a_miss_and_is_deleted(tmp_path, damage):
    d = _disk(tmp_path)
    h, g = b"a" * 32, b"b" * 32
    block = np.random.default_rng(1).integers(0, 256, 1000, dtype=np.uint8)
    d.put(h, block)
    d.put(g, block)
    d.drain()                              # the writer thread has put the files in place
    path = d.path(h)
    raw = bytearray(path.read_bytes())
    if damage == "truncate":
        raw = raw[:-1]
    elif damage == "flip":
        raw[500] ^= 1
    elif damage == "extend":
        raw += b"\0"
    elif damage == "foreign":              # another layout's (namespace's) file of the same block
        other = _disk(tmp_path / "o", ns=b"m" * 32)
        other.put(h, block)
        other.drain()
        raw = bytearray(other.path(h).read_bytes())
    else:                                  # block g's file under h's name
        raw = bytearray(d.path(g).read_bytes())
    path.write_bytes(bytes(raw))
    out = np.full(1000, 7, np.uint8)
    assert not d.get(h, out)
    assert (out == 7).all() and not path.exists() and h not in d and d.rejected == 1
    assert d.get(g, out) and out.tobytes() == block.tobytes()
    d.check()


def test_a_new_store_removes_an_earlier_runs_files(tmp_path):
    d = _disk(tmp_path)
    d.put(b"a" * 32, np.zeros(1000, np.uint8))
    d.drain()
    again = _disk(tmp_path)
    assert len(again) == 0 and not list(again.folder.iterdir())


class _GatedReplace:
    """os.replace for the disk writer that holds the files named until let go (and fails the next
    replace of a name added to `refuse`): the writer's turns, in a chosen order against put."""

    def __init__(self, monkeypatch, *names):
        self.real, self.refuse = os.replace, set()
        self.gates = {n: (threading.Event(), threading.Event()) for n in names}
        monkeypatch.setattr(os, "replace", self)

    def __call__(self, src, dst):
        name = os.path.basename(dst)
        if name in self.refuse:
            self.refuse.discard(name)
            raise OSError(28, "No space left on device")
        entered, go = self.gates.get(name, (None, None))
        if entered is not None and not entered.is_set():     # its first replace only
            entered.set()
            assert go.wait(10)
        return self.real(src, dst)

    def hold(self, name):                    # the writer is inside that file's replace
        assert self.gates[name][0].wait(10)
        return self.gates[name][1]


@pytest.mark.parametrize("then", ["evicted", "refused"])
def test_a_block_stored_again_while_written_leaves_no_file_when_it_goes(tmp_path, monkeypatch, then):
    """Block h is written; meanwhile it is evicted and stored again, so that write leaves its
    file to the later copy. The later copy is evicted before its turn (or the folder refuses it):
    the earlier file must go with it, or the folder holds a file the index does not."""
    d = _disk(tmp_path, files=2)
    h, g1, g2, x1, x2 = (bytes([i]) * 32 for i in range(5))
    block = np.arange(1000, dtype=np.uint32).astype(np.uint8)
    name = lambda k: d.path(k).name            # noqa: E731
    gate = _GatedReplace(monkeypatch, name(h), name(g2))
    d.put(h, block)
    go_h = gate.hold(name(h))                   # h's first write, about to land
    d.put(g1, block)
    d.put(g2, block)                            # h evicted while its write is in flight
    d.put(h, block)                             # and stored again (g1 out): a second copy queued
    if then == "refused":
        gate.refuse.add(name(h))                # the second copy's write fails (the first is past
                                                # that check, held in its replace)
        gate.gates[name(g2)][1].set()           # (g2's turn needs no holding)
        go_h.set()
    else:
        go_h.set()                              # the first write lands, its file left to the second
        go_g2 = gate.hold(name(g2))             # the writer is on g2, the second h copy queued
        d.put(x1, block)
        d.put(x2, block)                        # g2 and h out before h's second turn
        go_g2.set()
    d.check()                                   # the folder holds the index's files, no others
    assert h not in d and not d.path(h).exists()


# -- the engine over FakeRunner ------------------------------------------------------------------
class FakeCopies:
    """kv_copies for FakeRunner: a block is its pages' token and position slots."""

    def __init__(self, runner):
        self.r = runner
        self.block_bytes = 16 * runner.page_size
        self.slab = None

    def make_slab(self, rows):
        self.slab = np.zeros((rows, self.block_bytes), np.uint8)
        return self.slab

    def _slots(self, page):
        return slice(page * self.r.page_size, (page + 1) * self.r.page_size)

    def save(self, pages, rows):
        for p, row in zip(pages, rows):
            s = self._slots(p)
            self.slab[row] = np.concatenate([self.r.kv_tok[s], self.r.kv_pos[s]]).view(np.uint8)

    def load(self, pages, rows, after_steps=True):
        ps = self.r.page_size
        for p, row in zip(pages, rows):
            v = self.slab[row].view(np.int64)
            self.r.kv_tok[self._slots(p)], self.r.kv_pos[self._slots(p)] = v[:ps], v[ps:]

    def step_waits(self, fence):
        pass

    def host_wait(self, fence):
        pass


class LateCopies(FakeCopies):
    """A copy stream: copies land only when waited for (step_waits, host_wait) or, if nobody
    waits, after two more steps have run (the data they read or write is what is there then), so
    a step that does not wait for a restore, or overwrites a page whose save is still in flight,
    computes on the wrong KV."""

    def __init__(self, runner):
        super().__init__(runner)
        self.queue, self.issued = [], 0
        self.beside = 0                                  # restores that did not wait for steps
        self.stalls = 0                                  # step waits that had a copy still to land

    def save(self, pages, rows):
        return self._later(super().save, pages, rows)

    def load(self, pages, rows, after_steps=True):
        """after_steps=False: KVTiers says no step in flight has these pages; checked."""
        assert after_steps or not set(pages) & self.r.in_flight, "a restore beside a step using its pages"
        self.beside += not after_steps
        return self._later(super().load, pages, rows)

    def _later(self, copy, pages, rows):
        self.queue.append((self.issued, copy, list(pages), list(rows)))
        self.issued += 1
        return self.issued - 1

    def land(self, upto=None):
        while self.queue and (upto is None or self.queue[0][0] <= upto):
            _, copy, pages, rows = self.queue.pop(0)
            copy(pages, rows)

    def step_waits(self, fence):
        # a step stalls when a copy it waits for has not landed yet (a wait on a landed one is free)
        self.stalls += any(q[0] <= fence for q in self.queue)
        self.land(fence)

    def host_wait(self, fence):
        if fence is not None:
            self.land(fence)


class TieredFake(FakeRunner):
    def __init__(self, *a, late=False, **kw):
        super().__init__(*a, **kw)
        self.copies = (LateCopies if late else FakeCopies)(self)
        self.before = 0                                  # copies issued before the last step

    def kv_copies(self):
        return self.copies

    launched: dict = {}                                  # id(step) -> its pages, until collected

    @property
    def in_flight(self) -> set:
        """Pages of the steps launched and not collected yet."""
        return set().union(*self.launched.values())

    def launch(self, meta, sampling, feed=()):
        ps = self.page_size
        step = super().launch(meta, sampling, feed)
        self.launched = {**self.launched, id(step): {
            int(p) for b in range(meta.B) for p in meta.block_tables[b, :-(-int(meta.context_lens[b]) // ps)]}}
        return step

    def collect(self, step):
        self.launched = {k: v for k, v in self.launched.items() if k != id(step)}
        return super().collect(step)

    def execute(self, meta, sampling):
        start = getattr(self.copies, "issued", 0)
        out = super().execute(meta, sampling)
        if isinstance(self.copies, LateCopies):         # unwaited copies land a step late
            self.copies.land(self.before - 1)
        self.before = start
        return out


def _blocks_gib(n, page_size=4):
    return n * 16 * page_size / GIB


def _shared_prefix_prompts(rng, n, stems=12, stem_len=(8, 30), tail=(1, 9), vocab=97):
    stems = [rng.integers(0, vocab, int(rng.integers(*stem_len))).tolist() for _ in range(stems)]
    return [stems[int(rng.integers(len(stems)))] + rng.integers(0, vocab, int(rng.integers(*tail))).tolist()
            for _ in range(n)]


def _serve(engine, prompts, params, per_wave=8):
    """Requests in waves (later ones find what earlier ones left); outputs by request."""
    outs = {}
    for w in range(0, len(prompts), per_wave):
        for i in range(w, min(w + per_wave, len(prompts))):
            engine.add_request(prompts[i], params, f"r{i}")
        outs.update(drain(engine))
    return [outs[f"r{i}"][0] for i in range(len(prompts))]


@pytest.mark.parametrize("disk,late,at_compute", [(False, False, False), (True, False, False), (True, True, False),
                                                  (True, True, True)])
def test_outputs_with_tiers_equal_outputs_without(tmp_path, monkeypatch, disk, late, at_compute):
    """200 requests over 12 shared prefixes with a KV cache of 24 pages: evicted prefixes come
    back from the host pool (and, with a pool of 8 blocks, from the disk), outputs unchanged;
    late: copies that land only when waited for (the GPU's copy stream, LateCopies: a page handed
    out again before its save is issued makes the step wait); at_compute: blocks saved once, as
    the step computing them is issued (INFC_KV_SAVE_AT_COMPUTE)."""
    if at_compute:
        monkeypatch.setenv("INFC_KV_SAVE_AT_COMPUTE", "1")
    rng = np.random.default_rng(11)
    prompts = _shared_prefix_prompts(rng, 200)
    params = SamplingParams(max_tokens=6, **GREEDY)
    want = _serve(make_engine(FakeRunner(24)), prompts, params)
    cfg = (OffloadConfig(_blocks_gib(8), str(tmp_path), _blocks_gib(400) + 400 * HEADER.size / GIB) if disk
           else OffloadConfig(_blocks_gib(1000)))
    r = TieredFake(24, late=late)
    e = make_engine(r, kv_offloading=cfg)
    waits, wait = [], r.copies.step_waits
    r.copies.step_waits = lambda fence: waits.append(fence) or wait(fence)
    assert _serve(e, prompts, params) == want
    st = e.metrics.kv_offload
    # each device wait a step was made to do (the fake copies without a stream give no fences)
    assert st.step_waits == len(waits) and (len(waits) > 0) == late
    assert st.host_hit_tokens > 0 and st.bytes_to_host > 0 and st.bytes_to_device > 0
    assert e.metrics.external_prefix_cache_hits_total == st.host_hit_tokens + st.disk_hit_tokens
    assert e.metrics.external_prefix_cache_hits_total <= e.metrics.external_prefix_cache_queries_total
    assert (st.disk_hit_tokens > 0 and st.bytes_to_disk > 0) == disk
    assert not late or r.copies.beside > 0                  # restores that overlapped a step
    assert st.restore_seconds.count > 0
    assert_all_free(e)


def test_corrupted_disk_blocks_are_recomputed(tmp_path):
    """Every disk file damaged behind the store's back: misses, and the outputs stay right."""
    rng = np.random.default_rng(12)
    prompts = _shared_prefix_prompts(rng, 60, stems=6)
    params = SamplingParams(max_tokens=4, **GREEDY)
    want = _serve(make_engine(FakeRunner(24)), prompts, params)
    e = make_engine(TieredFake(24), kv_offloading=OffloadConfig(_blocks_gib(4), str(tmp_path), _blocks_gib(400) + 400 * HEADER.size / GIB))
    disk = e.tiers.disk
    outs = {}
    for w in range(0, len(prompts), 6):
        disk.drain()
        for f in disk.folder.iterdir():                  # damage whatever is there now
            raw = bytearray(f.read_bytes())
            if w % 12:
                raw[-3] ^= 0xFF
            else:
                raw = raw[:len(raw) // 2]
            f.write_bytes(bytes(raw))
        for i in range(w, min(w + 6, len(prompts))):
            e.add_request(prompts[i], params, f"r{i}")
        outs.update(drain(e))
    assert [outs[f"r{i}"][0] for i in range(len(prompts))] == want
    assert disk.rejected > 0                             # (files written since are good hits)
    assert_all_free(e)



def abort_while_adding(e, prompts, rng):
    """Add the prompts one by one (greedy, 8 tokens), stepping 0-2 times after each and aborting
    live requests at random (60 % chains), then abort the rest and step once."""
    params = SamplingParams(max_tokens=8, **GREEDY)
    live = []
    for i, p in enumerate(prompts):
        e.add_request(p, params, f"r{i}")
        live.append(f"r{i}")
        for _ in range(int(rng.integers(0, 3))):
            e.step()
        while live and rng.random() < 0.6:
            e.abort(live.pop(int(rng.integers(len(live)))))
        live = [x for x in live if x in e.requests]
    for x in live:
        e.abort(x)
    e.step()

def test_1000_aborts_under_offload_hold_nothing(tmp_path):
    rng = np.random.default_rng(13)
    prompts = _shared_prefix_prompts(rng, 1000, stems=20)
    r = TieredFake(32)
    e = make_engine(r, kv_offloading=OffloadConfig(_blocks_gib(6), str(tmp_path), _blocks_gib(30) + 30 * HEADER.size / GIB))
    abort_while_adding(e, prompts, rng)                 # its last step flushes the released blocks' copies
    assert not e.has_unfinished()
    assert_all_free(e)                                  # bm.check() checks the tiers too
    t = e.tiers
    assert not t.saves and not t.loads and not t.pool.pins
    assert len(t.pool) + len(t.pool.free) == t.pool.num_rows
    assert t.stats.host_hit_tokens + t.stats.disk_hit_tokens > 0
    t.disk.check()                                      # no file but the index's, none left open
    assert not list(t.disk.folder.glob("*.tmp"))


# -- the tiny real model -------------------------------------------------------------------------
@pytest.mark.parametrize("n,disk", [(200, True), pytest.param(200, False, marks=EXHAUSTIVE)])
def test_tiny_model_outputs_with_the_tiers_equal_outputs_without(tiny_plan, tmp_path, n, disk):
    """The real CPU path (numpy pages): 200 greedy requests over 8 shared prefixes with a KV cache
    of 12 pages of 4 tokens; a host pool of 6 blocks and a disk behind it (or a pool of 200)."""
    plan, weights = tiny_plan
    rng = np.random.default_rng(14)
    prompts = _shared_prefix_prompts(rng, n, stems=8, stem_len=(12, 20), tail=(1, 5), vocab=320)
    params = SamplingParams(max_tokens=3, **GREEDY)
    want = _serve(make_engine(CPURunner(plan, weights, 12, 4)), prompts, params, per_wave=3)
    runner = CPURunner(plan, weights, 12, 4)
    block = runner.kv_copies().block_bytes / GIB
    cfg = OffloadConfig(6 * block, str(tmp_path), 400 * (block + HEADER.size / GIB)) if disk else OffloadConfig(200 * block)
    e = make_engine(runner, kv_offloading=cfg)
    assert _serve(e, prompts, params, per_wave=3) == want
    st = e.metrics.kv_offload
    assert st.host_hit_tokens > 0 and (st.disk_hit_tokens > 0) == disk
    assert_all_free(e)


def test_offloading_settings_are_checked(tiny_plan, tmp_path):
    plan, weights = tiny_plan
    runner = CPURunner(plan, weights, 12, 4)
    with pytest.raises(ValueError, match="holds no KV block"):
        make_engine(runner, kv_offloading=OffloadConfig(1e-9))
    with pytest.raises(ValueError, match="needs --kv-offloading-disk-size"):
        make_engine(runner, kv_offloading=OffloadConfig(0.01, str(tmp_path)))
    with pytest.raises(ValueError, match="cannot copy KV pages"):
        make_engine(FakeRunner(8), kv_offloading=OffloadConfig(0.01))
    notes = []
    e = make_engine(runner, kv_offloading=OffloadConfig(0.01), enable_prefix_caching=False, log=notes.append)
    assert e.tiers is None and any("KV offloading off" in n for n in notes)


def test_offloading_flags_reach_the_config_and_bad_values_fail():
    from infc.cli import parser
    from infc.config import EngineConfig
    from infc.server.args import engine_config
    a = parser().parse_args(["serve", "--model-path", "m", "--kv-offloading-size", "2",
                             "--kv-offloading-disk", "/x", "--kv-offloading-disk-size", "8"])
    c = engine_config(a).cache
    assert (c.kv_offloading_size, c.kv_offloading_disk, c.kv_offloading_disk_size) == (2.0, "/x", 8.0)
    d = engine_config(parser().parse_args(["serve", "--model-path", "m"])).cache
    assert (d.kv_offloading_size, d.kv_offloading_disk, d.kv_offloading_disk_size) == (0, None, 0)
    never = lambda: pytest.fail("the cpu device needs no GPU table")  # noqa: E731
    for settings, match in [({"kv_offloading_size": -1}, "--kv-offloading-size must be >= 0"),
                            ({"kv_offloading_size": 1, "kv_offloading_disk": "/x"}, "go together"),
                            ({"kv_offloading_disk": "/x", "kv_offloading_disk_size": 1}, "needs --kv-offloading-size")]:
        with pytest.raises(ValueError, match=match):
            EngineConfig.from_settings(device="cpu", **settings).resolved(lambda: "cpu", never)


def test_a_disk_that_refuses_writes_drops_blocks_and_serving_goes_on(tmp_path, monkeypatch):
    import builtins
    rng = np.random.default_rng(15)
    prompts = _shared_prefix_prompts(rng, 40, stems=6)
    params = SamplingParams(max_tokens=4, **GREEDY)
    want = _serve(make_engine(FakeRunner(24)), prompts, params)
    e = make_engine(TieredFake(24), kv_offloading=OffloadConfig(_blocks_gib(4), str(tmp_path), 0.001))
    real_open = builtins.open

    def full_disk(path, mode="r", *a, **kw):
        if "w" in mode and str(path).endswith(".tmp"):
            raise OSError(28, "No space left on device")
        return real_open(path, mode, *a, **kw)
    monkeypatch.setattr(builtins, "open", full_disk)
    assert _serve(e, prompts, params) == want
    disk = e.tiers.disk
    disk.drain()
    assert disk.write_errors > 0 and len(disk) == 0 and not disk.pending
    assert_all_free(e)


def test_preempted_sequences_come_back_from_the_host_tier():
    """KV demand ~4x the cache: preempted sequences' full blocks (prompt and outputs) are restored
    from the host tier when they return, and every output is as alone."""
    from test_scheduler import solo
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 97, int(rng.integers(20, 40))).tolist() for _ in range(12)]
    params = SamplingParams(max_tokens=24, **GREEDY)
    r = TieredFake(20)
    e = make_engine(r, kv_offloading=OffloadConfig(_blocks_gib(200)))
    for i, p in enumerate(prompts):
        e.add_request(p, params, f"r{i}")
    outs = drain(e)
    assert e.metrics.num_preemptions_total > 0 and e.metrics.kv_offload.host_hit_tokens > 0
    assert all(outs[f"r{i}"][0] == solo(r, p, 24) for i, p in enumerate(prompts))
    assert_all_free(e)


def _runs(pages, rows) -> int:
    """Copies a restore takes per (cache, layer) on the GPU: runs of consecutive pages and rows."""
    return 1 + sum(1 for i in range(1, len(pages))
                   if (pages[i] - pages[i - 1], rows[i] - rows[i - 1]) != (1, 1))


def test_a_restored_prefix_is_copied_in_few_runs():
    """A 40-block prefix pushed out by another prompt and restored: its blocks' rows and fresh pages
    pair up in runs (the GPU issues one 2D copy per run and (cache, layer), not one per block)."""
    r = TieredFake(48)
    loads, saves = [], []
    load, save = r.copies.load, r.copies.save
    r.copies.load = lambda pages, rows, *a: loads.append((list(pages), list(rows))) or load(pages, rows, *a)
    r.copies.save = lambda pages, rows: saves.append((list(pages), list(rows))) or save(pages, rows)
    e = make_engine(r, kv_offloading=OffloadConfig(_blocks_gib(200)))
    rng = np.random.default_rng(16)
    a, b = rng.integers(0, 97, 161).tolist(), rng.integers(0, 97, 181).tolist()
    params = SamplingParams(max_tokens=2, **GREEDY)
    first = _serve(e, [a, b], params, per_wave=1)
    assert not loads and len(saves[0][0]) == 40 and _runs(*saves[0]) == 1     # a's blocks, saved
    assert len(saves[1][0]) == 45 and _runs(*saves[1]) <= 3     # b's: on pages a freed, last first
    assert _serve(e, [a], params) == first[:1]
    (pages, rows), = loads
    assert len(pages) >= 30 and _runs(pages, rows) <= 3, (pages, rows)
    assert_all_free(e)


def test_a_model_with_slot_caches_runs_without_tiers_and_says_so():
    """A runner of a plan with slot caches that keeps no state snapshots (no `state_copies`: rank
    processes, data-parallel ranks) runs without prefix caching, so without tiers: a note each."""
    r = TieredFake(16)
    r.num_slots = 4
    notes = []
    e = make_engine(r, kv_offloading=OffloadConfig(0.01), log=notes.append)
    assert e.tiers is None and e.bm.tiers is None and not e.bm.enable_prefix_caching
    assert any("prefix caching disabled" in n for n in notes) and any("KV offloading off" in n for n in notes)


def test_a_restore_into_pages_of_the_step_in_flight_waits_for_it():
    """Overlapped: S stops at a token read back while its next step is in flight; R, waiting for
    pages, is admitted onto S's pages and restores its prefix there. That restore must wait for
    the step in flight (LateCopies checks); restores onto other pages need not."""
    stop = SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[5])
    r = TieredFake(7, next_token=lambda ctx: 5)
    e = make_engine(r, kv_offloading=OffloadConfig(_blocks_gib(20)))
    r.copies = LateCopies(r)
    e.tiers.copies = r.copies
    r.copies.make_slab(e.tiers.pool.num_rows)
    e.tiers.slab = r.copies.slab
    assert e.overlap
    a = list(range(20, 32))                               # 3 blocks
    e.add_request(a + [1], stop, "fill")
    drain(e)
    e.tiers.demote(e.bm)                                  # a's blocks: host tier only
    waited = []
    load = r.copies.load
    r.copies.load = lambda pages, rows, after=True: waited.append(after) or load(pages, rows, after)
    e.add_request(list(range(40, 59)), stop, "S")        # 5 pages of 7
    e.add_request(a + [2], stop, "R")                     # 3 tier blocks + 1: waits for S's pages
    outs = drain(e)
    assert outs["S"][0] == [5] and outs["R"][0] == [5]
    assert e.metrics.kv_offload.host_hit_tokens == 12 and waited == [True]
    assert_all_free(e)


def test_the_tier_host_bench_times_the_tiers_python():
    """bench/tier_host.py (issue 44's CPU measurement) at a tiny size: every sequence finishes,
    each finished one's full computed blocks are saved once, and the driver calls it counts for
    the staged saves are an upload and, a chunk, a launch and at least one copy."""
    from infc.bench.tier_host import run
    kw = dict(page_size=4, num_pages=None, host_rows=None, concurrency=4, in_len=15, out_len=6)
    r = run(True, **kw)
    assert r["sequences"] == 8 and r["tier_s"] > 0
    # 20 of 21 tokens computed (the last sampled one never is): 5 full blocks of 4 a sequence
    assert r["blocks_saved"] == 8 * 5
    calls = r["save_calls"]
    assert calls["mapped"] == 2 * r["batches"] and calls["staged"] >= 3 * r["batches"]
    assert "blocks_saved" not in run(False, **kw)


def test_the_tier_host_bench_times_warm_hbm_hits():
    """bench/tier_host.py --hits: every warm request hits its prompt's whole cached prefix on the
    device (the 64-token prompt's 4 blocks of 16: the hit is 80 tokens long), and with
    the tier on (write-back, pages to spare) no block is copied to the host."""
    from infc.bench.tier_host import hits
    kw = dict(page_size=16, num_pages=6000, cold=2, warm=3)
    for tier in (False, True):
        r = hits(tier, [64], **kw)
        assert r[64] > 0 and r["hit_tokens"] == 3 * 4 * 16, r
    assert r["blocks_saved"] == 0


@pytest.mark.parametrize("at_compute", [False, True])
def test_blocks_are_saved_when_released_or_once_as_computed(monkeypatch, at_compute):
    """By default a block goes to the host tier when its sequence lets it go: all 13 of a
    sequence's blocks in the step it ends. Under INFC_KV_SAVE_AT_COMPUTE it goes at the flush after
    the step that computes it (the prompt's 10 blocks after its prefill, each decode block after
    its step), never again at release, even from a pool too small to keep them all (so each block is
    copied once), and its saves never make a step wait (the pages are only read: copies that land
    late, LateCopies). Either way the outputs are the tier-free run's."""
    if at_compute:
        monkeypatch.setenv("INFC_KV_SAVE_AT_COMPUTE", "1")
    rng = np.random.default_rng(5)
    params = SamplingParams(max_tokens=13, **GREEDY)
    prompts = [rng.integers(0, 97, 41).tolist() for _ in range(3)]
    base = make_engine(FakeRunner(48))
    want = []
    for i, p in enumerate(prompts):
        base.add_request(p, params, f"r{i}")
        want.append(drain(base)[f"r{i}"][0])
    r = TieredFake(48, late=True)
    e = make_engine(r, kv_offloading=OffloadConfig(_blocks_gib(8)))      # 8 rows: fewer than a sequence holds
    log, save = [], r.copies.save
    r.copies.save = lambda pages, rows: log.append(len(pages)) or save(pages, rows)
    for i, p in enumerate(prompts):
        e.add_request(p, params, f"r{i}")
        by_step, got = [], []
        while e.has_unfinished():
            n = len(log)
            outs = e.step()
            got += [t for o in outs for t in o.token_ids]
            by_step.append((sum(log[n:]), any(o.request_finished for o in outs)))
        assert got == want[i]
        # 41 + 13 tokens, the last never computed: 53 computed, 13 full blocks of 4
        assert sum(n for n, _ in by_step) == 13
        last = next(n for n, done in by_step if done)
        if at_compute:
            assert last <= 1 and by_step[0][0] == 10          # the prompt's 10 blocks after its prefill
        else:
            assert last == 13 and sum(n for n, done in by_step if not done) == 0
    st = e.metrics.kv_offload
    assert st.bytes_to_host == 3 * 13 * r.copies.block_bytes        # each block once
    assert not at_compute or st.step_waits == 0                    # held blocks are only read
    assert_all_free(e)


def _one_by_one(e, prompts, params, tag):
    """Each prompt served alone, in turn: its tokens, and bytes saved after each."""
    got, saved = [], []
    for i, p in enumerate(prompts):
        e.add_request(p, params, f"{tag}{i}")
        got.append(drain(e)[f"{tag}{i}"][0])
        saved.append(e.tiers.stats.bytes_to_host if e.tiers is not None else 0)
    return got, saved


def test_write_back_saves_only_blocks_the_next_allocations_may_evict(monkeypatch):
    """The default timing (write-back): a finished sequence's blocks stay on their pages, not
    copied, while the free queue has `ahead` other pages before them (here 4 steps of at most 8
    tokens / 4 per page + 1 sequence = 12 pages); as later sequences take pages and their blocks
    come within 12 of the front they are copied out, so no step waits for a save (copies that land
    only two steps late, LateCopies) and the first prompt is restored from the host, outputs the
    tier-free run's. INFC_KV_SAVE_EAGER=1 copies every block at release."""
    rng = np.random.default_rng(8)
    params = SamplingParams(max_tokens=5, **GREEDY)
    prompts = [rng.integers(0, 97, 37).tolist() for _ in range(8)]        # 10 blocks a sequence
    again = [prompts[0] + [5, 6, 7]]
    kw = dict(max_num_seqs=1, max_num_batched_tokens=8)
    base = make_engine(FakeRunner(64), **kw)
    want, _ = _one_by_one(base, prompts + again, params, "r")
    r = TieredFake(64, late=True)
    e = make_engine(r, kv_offloading=OffloadConfig(_blocks_gib(100)), **kw)
    assert e.tiers.ahead == 4 * (8 // 4 + 1)
    got, saved = _one_by_one(e, prompts, params, "r")
    # sequences 1-4 take the 64 never-used pages (10 or 11 each) and no block comes near the front
    assert saved[:4] == [0, 0, 0, 0]
    assert saved[-1] > 0 and r.copies.stalls == 0
    got += _one_by_one(e, again, params, "a")[0]
    assert got == want
    assert e.metrics.kv_offload.host_hit_tokens > 0
    assert_all_free(e)
    monkeypatch.setenv("INFC_KV_SAVE_EAGER", "1")
    eager = make_engine(TieredFake(64, late=True), kv_offloading=OffloadConfig(_blocks_gib(100)), **kw)
    assert eager.tiers.ahead == 0
    _, saved = _one_by_one(eager, prompts[:1], params, "r")
    assert saved == [10 * 16 * 4]                                          # all 10 blocks at release


def test_a_dirty_block_handed_out_before_its_save_is_saved_first():
    """A step that takes more pages than the tier looks ahead (a 64-token chunk: 16 pages, ahead
    12) reaches dirty blocks the flush never saw: each is copied out before that step writes its
    page, the step waiting for the copy (copies land late unless waited for, so a missing wait
    would save the new KV under the old block's hash), and the old prompt comes back from the
    host as it was."""
    rng = np.random.default_rng(9)
    params = SamplingParams(max_tokens=3, **GREEDY)
    first = rng.integers(0, 97, 40).tolist()
    rest = [rng.integers(0, 97, 60).tolist() for _ in range(3)]
    again = [first + [1, 2]]
    base = make_engine(FakeRunner(32), max_num_seqs=1, max_num_batched_tokens=64)
    want, _ = _one_by_one(base, [first] + rest + again, params, "r")
    r = TieredFake(32, late=True)
    e = make_engine(r, kv_offloading=OffloadConfig(_blocks_gib(100)), max_num_seqs=1, max_num_batched_tokens=64)
    e.tiers.write_back(12, 32)
    got, _ = _one_by_one(e, [first] + rest + again, params, "r")
    assert got == want
    # every one of the first prompt's 10 blocks came back from the host, some saved by a stall
    assert r.copies.stalls > 0 and e.metrics.kv_offload.host_hit_tokens == 40
    assert_all_free(e)


def test_write_back_counts_each_dirty_pages_place_in_the_free_queue():
    """Write-back finds the dirty blocks near the free queue's front by counting (tickets, the
    front, the holes prefix hits leave), not by walking the queue: under shared prefixes (hits
    take pages from the middle) the counted place of every dirty page is its place in the queue
    after every step, and the outputs are the tier-free run's."""
    rng = np.random.default_rng(13)
    prompts = _shared_prefix_prompts(rng, 80, stems=6)
    params = SamplingParams(max_tokens=5, **GREEDY)
    want = _serve(make_engine(FakeRunner(64)), prompts, params)
    e = make_engine(TieredFake(64, late=True), kv_offloading=OffloadConfig(_blocks_gib(40)))
    e.tiers.write_back(10, 64)
    checked = holes = 0
    outs = {}
    for w in range(0, len(prompts), 8):
        for i in range(w, min(w + 8, len(prompts))):
            e.add_request(prompts[i], params, f"r{i}")
        while e.has_unfinished():
            for o in e.step():
                outs.setdefault(o.request_id, []).extend(o.token_ids)
            assert e.tiers.check_places(e.bm.free) == 0          # every place counted exactly
            checked += len(e.tiers.dirty)
            holes = max(holes, len(e.tiers._holes))
    assert [outs[f"r{i}"] for i in range(len(prompts))] == want
    assert checked > 100 and holes > 0 and e.metrics.kv_offload.host_hit_tokens > 0
    assert_all_free(e)


def test_write_back_holes_stay_bounded_under_repeated_hits():
    """Every hit on one long prefix takes its pages from the middle of the free queue (holes in
    its tickets) and its release tickets them again at the tail: the holes are renumbered away
    once they outnumber the queue (before, 60 hits of 40 blocks left 2,360 against a queue of
    600), and every counted place stays exact."""
    rng = np.random.default_rng(17)
    prefix = rng.integers(0, 97, 4 * 40).tolist()                # 40 full blocks of 4
    e = make_engine(TieredFake(600), kv_offloading=OffloadConfig(_blocks_gib(100)),
                    max_num_batched_tokens=256, max_num_seqs=4)
    e.tiers.write_back(8, 600)
    params = SamplingParams(max_tokens=2, **GREEDY)
    most = 0
    for i in range(60):
        e.add_request(prefix + rng.integers(0, 97, 3).tolist(), params, f"r{i}")
        while e.has_unfinished():
            e.step()
            assert e.tiers.check_places(e.bm.free) == 0
            most = max(most, len(e.tiers._holes))
    assert 40 <= most <= len(e.bm.free) + 40, most               # a hit's holes, never hits' worth
    assert e.bm.hit_tokens == 59 * 160                           # every later request hit the prefix
    assert_all_free(e)


def test_write_back_beside_speculation():
    """n-gram speculation hands rejected drafts' pages back to the free queue's front (truncate),
    which the write-back count does not see: it may then place a dirty page before its real place
    (saving early), never after it; under shared prefixes, a small KV cache and rejections, every
    output is the model's own, and the first prompt comes back from the host."""
    from infc.config import speculative_config
    from test_scheduler import solo

    def next_token(ctx):              # repeats itself 5 back (drafts land), but not every 9th token
        return int(ctx[-5]) if len(ctx) >= 5 and len(ctx) % 9 else int(len(ctx) % 97)
    rng = np.random.default_rng(21)
    stems = [rng.integers(0, 97, 14).tolist() for _ in range(3)]
    prompts = [stems[i % 3] + rng.integers(0, 97, 3).tolist() for i in range(6)]     # hits on stems
    prompts += [rng.integers(0, 97, 17).tolist() for _ in range(6)] + [stems[0] + [1, 2, 3]]
    spec = speculative_config({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                               "prompt_lookup_max": 3})
    r = TieredFake(24, late=True, next_token=next_token)
    e = make_engine(r, kv_offloading=OffloadConfig(_blocks_gib(60)), speculative_config=spec)
    e.tiers.write_back(6, 24)
    got, early = [], 0
    for i, p in enumerate(prompts):
        e.add_request(p, SamplingParams(max_tokens=16, **GREEDY), f"r{i}")
        out = []
        while e.has_unfinished():
            for o in e.step():
                out += o.token_ids
            early += e.tiers.check_places(e.bm.free)         # never later than the real place
        got.append(out)
    assert got == [solo(r, p, 16) for p in prompts]
    m = e.metrics
    assert m.spec_decode_num_accepted_tokens_total > 0 and m.spec_decode_num_draft_tokens_total > \
        m.spec_decode_num_accepted_tokens_total                     # some drafts rejected: truncated
    assert early > 0 and m.kv_offload.host_hit_tokens > 0
    assert_all_free(e)


def test_write_back_bookkeeping_is_one_call_a_sequence_and_no_object_a_page(monkeypatch):
    """A prefix hit's pages reach the tiers in one call (taken) and a finished sequence's in one
    call (released), and under write-back neither makes an object the garbage collector tracks
    for each page: a 32k prompt is 2,048 pages, and per-page calls and tuples were most of an HBM
    hit's extra host time with the tier on (collections walking the process; bench/NOTES.md)."""
    import gc
    from infc.runtime.engine.kv_tier.tiers import KVTiers
    calls = {"taken": [], "released": []}
    for name in calls:
        orig = getattr(KVTiers, name)

        def spy(self, pages, *rest, _orig=orig, _name=name):
            calls[_name].append(len(pages))
            return _orig(self, pages, *rest)
        monkeypatch.setattr(KVTiers, name, spy)
    params = SamplingParams(max_tokens=2, **GREEDY)
    prompt = np.random.default_rng(5).integers(0, 97, 4 * 300 + 2).tolist()   # 300 full blocks
    e = make_engine(TieredFake(5000), kv_offloading=OffloadConfig(_blocks_gib(900)),
                    max_num_batched_tokens=2048, max_num_seqs=8)
    assert e.tiers.ahead == 4 * (2048 // 4 + 8)
    for i in range(2):                                       # cold, then a hit on its 300 blocks
        e.add_request(prompt, params, f"r{i}")
        drain(e)
    assert calls["released"] == [301, 301] and calls["taken"] == [300]
    assert len(e.tiers.dirty) == 300                         # nothing near the front: none saved
    # the collector's count of tracked objects made by one release and one take of 300 pages
    seq_pages = list(e.bm.free)[-301:]
    gc.disable()
    try:
        before = gc.get_count()[0]
        e.tiers.taken(seq_pages, e.bm.free)
        e.tiers.released(seq_pages, [e.bm.blocks[p].hash for p in seq_pages])
        made = gc.get_count()[0] - before
    finally:
        gc.enable()
    assert made < 20, made
    e.bm.check()
