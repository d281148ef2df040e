"""State snapshots: prefix caching for plans with slot caches (hybrid models' conv and recurrent
state; docs/architecture.md, "Hybrid prefix caching").

A cached KV prefix restores the attention layers, not the state a linear-attention layer keeps
after those tokens. So at a block boundary a step ends on (the end of a prefill chunk, which the
scheduler cuts at block boundaries, and the prompt's last block boundary) the sequence's slot is
copied into a snapshot, a slot of every slot cache kept in a pool of its own, named by the same
prefix hash as the block that ends there. A prefix hit is usable only up to a block whose
snapshot exists (BlockManager cuts the hit there); admission then copies the snapshot into the
sequence's slot, and the kernels, seeing tokens cached, start from that state.

The pool holds `num` snapshots, least recently used evicted first (a snapshot is as large as
hundreds or thousands of tokens of KV, so there are few). Without KV tiers, a snapshot goes when
its block leaves the prefix cache (useless without it) or when the pool needs its slot. With the
tiers, snapshots leaving the pool go to a KVTiers of their own (kv_tier/tiers.py over the
runner's snapshot copies: a host pool and the disk, as blocks do, keyed by the same hashes), and
come back into the pool when a prefix hit needs them.

The copies are the runner's (`runner.state_copies()`): save(slot, snap) and restore(snap, slot),
on the CPU numpy copies, on the GPU device-to-device copies on the steps' stream, so they fall
between the steps as issued: saves right after the step that computed the state is launched,
restores right before the step that reads it.
"""
import hashlib
from collections import OrderedDict

from .block_manager import Block


class StateSnapshots:
    def __init__(self, copies, num: int, tiers=None):
        if num < 1:
            raise ValueError(f"a state snapshot pool needs at least one snapshot, got {num}")
        self.copies, self.num, self.tiers = copies, num, tiers
        self.blocks = [Block(i) for i in range(num)]      # hash: its prefix; ref: pending restores
        self.lru: OrderedDict[bytes, int] = OrderedDict()  # hash -> snapshot, least recent first
        self.free: list[int] = list(range(num - 1, -1, -1))
        self.restores: list[tuple] = []                   # (snapshot, sequence, its slot then)
        self.saved = self.restored = 0                    # snapshots copied in / out (tests, metrics)

    def __contains__(self, h: bytes) -> bool:
        return h in self.lru or (self.tiers is not None and self.tiers.find(h))

    def longest(self, hashes: list[bytes], n: int) -> int:
        """The most of the first n blocks (hashes) a hit can take: up to the last with a snapshot."""
        for i in range(n, 0, -1):
            if hashes[i - 1] in self:
                return i
        return 0

    # -- pool slots ------------------------------------------------------------------------------
    def _take(self) -> int | None:
        """A snapshot slot to fill: a free one, else the least recently used one not waiting to
        be restored (with tiers: offered to them first). None: every one is pinned."""
        if self.free:
            return self.free.pop()
        for h, snap in self.lru.items():
            if self.blocks[snap].ref == 0:
                self._drop(h, snap)
                return snap
        return None

    def _drop(self, h: bytes, snap: int):
        del self.lru[h]
        self.blocks[snap].hash = None
        if self.tiers is not None:
            self.tiers.released([snap], [h])

    def forget(self, h: bytes):
        """Block h left the prefix cache (and no tier keeps it): its snapshot can never be used."""
        snap = self.lru.get(h)
        if snap is not None and self.blocks[snap].ref == 0:
            self._drop(h, snap)
            self.free.append(snap)

    # -- admission -------------------------------------------------------------------------------
    def acquire(self, h: bytes) -> int | None:
        """The pool's snapshot of block h, pinned until restored or released; fetched from the
        tiers into a pool slot when it is only there. None: not to be had (a bad disk file, or
        every slot pinned): the hit cannot use this boundary."""
        snap = self.lru.get(h)
        if snap is None:
            if self.tiers is None:
                return None
            rows = self.tiers.fetch([h], [None])
            if not rows:
                return None
            snap = self._take()
            if snap is None:
                self.tiers.unfetch(rows)
                return None
            self.tiers.reusing(snap)
            self.blocks[snap].hash = h
            self.lru[h] = snap
            self.tiers.restore(h, snap, rows[0])          # copied in at the flush before the step
        self.lru.move_to_end(h)
        self.blocks[snap].ref += 1
        return snap

    def release(self, snap: int):
        """An acquired snapshot not restored after all (the admission did not go through)."""
        self.blocks[snap].ref -= 1

    def restore(self, snap: int, seq):
        """Copy an acquired snapshot into seq's slot before the next step (before_launch)."""
        self.restores.append((snap, seq, seq.slot))

    def before_launch(self):
        """Issue what the step about to launch reads: the tiers' copies into the pool, then the
        snapshots into the admitted sequences' slots."""
        if self.tiers is not None:
            self.tiers.flush(self.blocks, before_launch=True)
        restores, self.restores = self.restores, []
        for snap, seq, slot in restores:
            if seq.slot == slot and not seq.finished:     # not aborted since its admission
                self.copies.restore(snap, slot)
                self.restored += 1
            self.blocks[snap].ref -= 1

    # -- after a step ----------------------------------------------------------------------------
    def save(self, items):
        """(hash, slot) pairs: slot holds the state at the end of block `hash` (the step just
        launched computed it); keep a snapshot of each not kept yet."""
        todo, seen = [], set()
        for h, slot in items:
            if h in self.lru:
                self.lru.move_to_end(h)
                continue
            if h in seen:
                continue
            snap = self._take()
            if snap is None:
                continue
            seen.add(h)
            todo.append((h, slot, snap))
        if not todo:
            return
        if self.tiers is not None:
            # the snapshots just evicted leave for the host before their slots are written over:
            # their copies are issued now, and the copies below wait for them (their slots hold
            # no hash yet, so the flush makes the stream wait)
            for _, _, snap in todo:
                self.tiers.reusing(snap)
            self.tiers.flush(self.blocks)
        for h, slot, snap in todo:
            self.blocks[snap].hash = h
            self.lru[h] = snap
            self.copies.save(slot, snap)
        self.saved += len(todo)

    def after_step(self):
        """The engine's flush after a step: evicted snapshots' copies to the host."""
        if self.tiers is not None:
            self.tiers.flush(self.blocks)

    def check(self):
        """Accounting (tests): every snapshot slot is free or holds one hash; nothing pinned."""
        held = list(self.lru.values())
        assert len(set(held)) == len(held), "a snapshot slot holds two prefixes"
        assert not set(held) & set(self.free), "a snapshot slot is both free and held"
        assert len(held) + len(self.free) == self.num, (len(held), len(self.free), self.num)
        assert not self.restores and all(b.ref == 0 for b in self.blocks), "a snapshot is pinned"
        for h, snap in self.lru.items():
            assert self.blocks[snap].hash == h
        if self.tiers is not None:
            self.tiers.check()


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024


def snapshot_copies(runner, dp: int, log=None):
    """The runner's state copies when prefix caching can run over its slot caches; None (with a
    note) when it cannot: data-parallel ranks, a runner without them, or no snapshot pool."""
    make = getattr(runner, "state_copies", None)
    copies = make() if callable(make) and dp == 1 else None
    if copies is None and log:
        log("  prefix caching disabled: this model keeps per-sequence state (slot caches) and "
            "this runner keeps no snapshots of it (data-parallel ranks, rank processes, or "
            "--num-state-snapshots 0)")
    return copies


def split_offloading(runner, copies, config):
    """(the KV blocks' tier config, the snapshots') out of one --kv-offloading-size (and disk size):
    the snapshots take the share of it that their pool takes of the device's cache memory, and at
    least room for as many snapshots as the pool holds, up to half of it."""
    if config is None or not config.enabled or copies is None:
        return config, None
    from infc.compiler.contract import caches
    from .kv_tier.disk_store import HEADER
    from .kv_tier.tiers import GIB
    decl = caches.of_plan(runner.plan)
    pool = caches.snapshot_pool_bytes(decl, copies.num)
    share = pool / (pool + runner.num_pages * caches.page_bytes(decl, runner.page_size))

    def part(gib: float, each: int) -> float:
        return max(gib * share, min(copies.num * each / GIB, gib / 2))

    host = part(config.host_gib, copies.snapshot_bytes)
    disk = part(config.disk_gib, copies.snapshot_bytes + HEADER.size) if config.disk_dir else 0.0
    kv = type(config)(config.host_gib - host, config.disk_dir, config.disk_gib - disk)
    return kv, type(config)(host, config.disk_dir, disk)


def for_engine(runner, copies, config, block_tiers, log=None) -> StateSnapshots:
    """The engine's snapshot pool over the runner's copies; with the KV tiers on (block_tiers),
    a KVTiers of its own for snapshots (config: its share of the host and disk sizes)."""
    from infc.compiler.contract import caches
    from .kv_tier import tiers as kv_tiers
    tiers = None
    if block_tiers is not None and config is not None:
        tc = copies.tier_copies()
        space = kv_tiers.namespace(runner, tc.block_bytes)
        name = hashlib.sha256(b"state-snapshots" + space).digest()
        why = None
        for cfg in (config, type(config)(config.host_gib)) if config.disk_dir else (config,):
            try:
                tiers = kv_tiers.KVTiers(tc, cfg, name, runner.page_size)
                break
            except ValueError as e:                      # its share holds no snapshot
                why = e
        if log and why is not None:
            log(f"  state snapshots: {'no disk tier' if tiers is not None else 'no host tier'} for them "
                f"(their share of the offloading sizes holds none: {why})")
    snaps = StateSnapshots(copies, copies.num, tiers)
    if log:
        decl = caches.of_plan(runner.plan)
        size = getattr(copies, "itemsize", None)            # the CPU's float32 storage
        one, kv_token = caches.slot_bytes(decl, size), caches.token_bytes(decl, size)
        log(f"  prefix caching with state snapshots: {copies.num} snapshots of the slot caches "
            f"({', '.join(n for n, c in decl.items() if c['kind'] == 'slot')}) x {_human(one)} = "
            f"{_human(copies.pool_bytes)}; a snapshot weighs as much as {one / max(kv_token, 1):,.0f} "
            f"tokens of KV ({_human(kv_token)} a token); per cached token {_human(one / 1024)} at one "
            f"snapshot a 1k-token prefix ({_human(one / runner.page_size)} at one a block)"
            + (f"; host tier {tiers.capacity_rows} snapshots" if tiers is not None else ""))
    return snaps
