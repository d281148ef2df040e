"""The CUDA runner's state snapshots (hybrid prefix caching, runtime/engine/state_snapshots.py):
a pool of snapshots in one device allocation of its own (compiler/contract/caches.py
snapshot_decl: a snapshot is a one-token "page" of each slot cache and layer), and the copies
between a running slot and a snapshot: one device-to-device copy a slot (cache, layer), on the
steps' stream, so a save issued after a step's launch reads the state that step leaves and a
restore issued before a launch is what that step reads (DeviceCaches.save_state / restore_state).
The snapshots' KV tiers move pool "pages" to and from pinned host rows with kv_copies.py's
DeviceCopies, as blocks move. The CPU runner's counterpart is runtime/engine/runner.py's
HostStateCopies."""
from infc.compiler.contract import caches


class DeviceStateCopies:
    def __init__(self, ctx, device_caches: caches.DeviceCaches, num: int, kernel=None):
        """kernel: the plan's block_copy kernel for the snapshots' tier copies (or None)."""
        self.ctx, self.caches, self.num, self.itemsize = ctx, device_caches, num, None   # the plan's dtypes
        self.kernel = kernel
        decl = caches.snapshot_decl(device_caches.layout.caches)
        self.pool = caches.DeviceCaches(ctx, decl, 1, num, zero=False)
        self.snapshot_bytes = self.pool.layout.block_bytes
        self.pool_bytes = self.pool.nbytes

    def save(self, slot: int, snap: int):
        self.caches.save_state(self.pool, slot, snap)

    def restore(self, snap: int, slot: int):
        self.caches.restore_state(self.pool, snap, slot)

    def tier_copies(self):
        from .kv_copies import DeviceCopies
        return DeviceCopies(self.ctx, self.pool, self.kernel)
