"""P2P collectives: a one-shot all-reduce over the ranks' own memory, mapped into each other's
address space (CUDA IPC; NVLink between the GPUs), for small messages: a batch-1 decode step's
sublayer outputs (qwen3-4b at TP=2: 72 all-reduces of 5 KB a token).

Measured on 2 x H100 (NV18, NCCL 2.28.9, bench/allreduce.py, in CUDA Graphs): one all-reduce costs
6.8-7.5 us through NCCL up to 160 KB and 6.9-7.3 us through peer_sum up to 80 KB; above that NCCL
wins (1.3 MB: 15.3 vs 18.5 us, 7.8 MB: 45 vs 78 us). So the slots hold 64 KiB by default and larger
messages go to NCCL. In qwen3-4b's TP=2 decode peer_sum gave 3.21-3.23 ms against 3.35-3.36 ms
with NCCL alone; in qwen3-30b-a3b's TP2 x EP2 decode no gain (bench/NOTES.md, issue 14). What it
brings besides: the rank-ordered sum (the numpy reference's bits), and a Triton kernel that later
fusions (the residual add and RMSNorm after the all-reduce) can grow from.

Each rank allocates one region and shares its IPC handle (an NCCL all-gather of 64 bytes):

    flags    [MAX_PROGRAMS, world] int64   rank q's program g raises flags[g, q] in my region
    counter  [MAX_PROGRAMS] int64          my program g's call count (its epoch)
    err      int32                         1 once a wait gave up (a peer never came)
    stage    2 slots x `capacity` bytes     my rows for the peers to read (slot = epoch % 2)

An all_reduce or ep_combine whose message fits a slot runs the `peer_sum` helper (codegen_templates/
triton/peer_sum.py.j2 has the protocol): each rank stages its rows, raises its flag in every
region, waits for every rank's flag and sums the ranks' staged rows in rank order in fp32, rounded
once: the numpy reference's bits, the same on every rank. Larger messages go to NCCL; the choice
depends only on the message size, so every rank makes the same one. all_gather and ep_dispatch
stay on NCCL.

A rank whose peer died waits in peer_sum as it would in NCCL. `abort()` (the rank watchdog's way
out, runtime/distributed/rank_workers.py) raises every flag of this rank's region from a side stream, so a
waiting kernel finishes (with garbage) and the step fails on the host; then it aborts NCCL. The
wait also gives up by itself after SPIN_LIMIT polls (minutes), setting err, which close() reports.

If any rank cannot map a peer's region (no peer access between the GPUs), every rank falls back
to NCCL alone (the ranks agree: an NCCL min over their answers). INFC_P2P=0 turns P2P off (A/B runs);
INFC_P2P_BYTES sets the slot capacity (default 64 KiB).
"""
import ctypes
import sys

import numpy as np

from infc import envs
from .collectives import NcclCollectives, agreed_min, bound_helper
from .driver import check, cu

HANDLE_BYTES = 64                    # CU_IPC_HANDLE_SIZE
MAX_PROGRAMS = 64                    # flag rows per region: peer_sum's grid never exceeds it
ALIGN = 256


def _up(n: int, a: int = ALIGN) -> int:
    return -(-n // a) * a


class RegionLayout:
    """Byte offsets of a rank's region (the same on every rank)."""

    def __init__(self, world: int, capacity: int):
        self.world = world
        self.capacity = _up(capacity)
        self.flags = 0
        self.counter = _up(MAX_PROGRAMS * world * 8)
        self.err = self.counter + _up(MAX_PROGRAMS * 8)
        self.stage = self.err + ALIGN
        self.nbytes = self.stage + 2 * self.capacity

    def slot_elems(self, itemsize: int) -> int:
        """Elements of one slot, a multiple of 64 (peer_sum keeps its rows 16-byte aligned)."""
        return self.capacity // itemsize // 64 * 64


# -- CUDA IPC (the CPU tests give P2PCollectives its regions directly) ----------------------------
def ipc_handle(ptr: int) -> bytes:
    h = check(cu.cuIpcGetMemHandle(ptr), "cuIpcGetMemHandle")
    return ctypes.string_at(h.getPtr(), HANDLE_BYTES)


def ipc_open(handle: bytes) -> int:
    h = cu.CUipcMemHandle()
    ctypes.memmove(h.getPtr(), handle, HANDLE_BYTES)
    flags = cu.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
    return int(check(cu.cuIpcOpenMemHandle(h, flags), "cuIpcOpenMemHandle"))


def ipc_close(ptr: int):
    check(cu.cuIpcCloseMemHandle(ptr), "cuIpcCloseMemHandle")


def _all_gather_bytes(comm, ctx, mine: bytes) -> list[bytes]:
    """Every rank's `mine` (equal lengths), rank order, over NCCL on ctx's stream."""
    n, world = len(mine), comm.world
    send, recv = ctx.alloc(n), ctx.alloc(n * world)
    try:
        keep = ctx.htod(send, np.frombuffer(mine, np.uint8).copy())
        comm.all_gather(send, recv, n, "u8", ctx.stream)
        out = np.empty(n * world, np.uint8)
        ctx.dtoh(out, recv)
        ctx.sync()
        del keep
        return [out[q * n:(q + 1) * n].tobytes() for q in range(world)]
    finally:
        ctx.free(send)
        ctx.free(recv)


def _agree_all(comm, ctx, ok: bool) -> bool:
    return agreed_min(comm, ctx, int(ok)) == 1


def p2p_collectives(comm, ctx, capacity: int | None = None) -> NcclCollectives:
    """P2PCollectives for this rank if every rank can map every other rank's region, else (on
    every rank alike) plain NcclCollectives; a line on stderr says which and why."""
    if comm.world == 1 or not envs.value("INFC_P2P"):
        return NcclCollectives(comm, ctx)
    capacity = capacity or envs.value("INFC_P2P_BYTES")
    layout = RegionLayout(comm.world, capacity)
    local = _alloc_region(ctx, layout)
    handles = _all_gather_bytes(comm, ctx, ipc_handle(local))
    regions, opened, why = [], [], ""
    for q, h in enumerate(handles):
        if q == comm.rank:
            regions.append(local)
            continue
        try:
            ptr = ipc_open(h)
        except Exception as e:       # noqa: BLE001 - every rank learns of it below, and falls back
            why = f"rank {comm.rank} cannot map rank {q}'s memory: {e}"
            break
        regions.append(ptr)
        opened.append(ptr)
    if not _agree_all(comm, ctx, not why):
        for p in opened:
            ipc_close(p)
        _free_region(local)
        sys.stderr.write(f"infc rank {comm.rank}: one-shot all-reduce off, NCCL only "
                         f"({why or 'another rank cannot map the regions'})\n")
        return NcclCollectives(comm, ctx)
    return P2PCollectives(comm, ctx, layout, local, regions, opened)


def _alloc_region(ctx, layout: RegionLayout) -> int:
    """A region outside the context's own allocations: close() frees it after the peers' maps
    (and it outlives ctx.close(), which CudaRunner.close runs first)."""
    ptr = int(check(cu.cuMemAlloc(layout.nbytes), f"cuMemAlloc({layout.nbytes})"))
    ctx.memset(ptr, layout.nbytes)
    ctx.sync()
    return ptr


def _free_region(ptr: int):
    check(cu.cuMemFree(ptr), "cuMemFree")


class P2PCollectives(NcclCollectives):
    """NcclCollectives whose small all_reduce / ep_combine run peer_sum over the mapped regions.
    regions: every rank's region as mapped in this process (rank order; this rank's is `local`);
    opened: the ones to unmap at close; free_local: the region is this object's to free."""

    def __init__(self, comm, ctx, layout: RegionLayout, local: int, regions: list[int],
                 opened: list[int] = (), free_local: bool = True):
        super().__init__(comm, ctx)
        if len(regions) != self.world or regions[self.rank] != local:
            raise ValueError(f"rank {self.rank} of {self.world}: {len(regions)} regions given, "
                             f"this rank's must be its own")
        self.layout, self.local, self.regions = layout, local, list(regions)
        self._opened, self._free_local = list(opened), free_local
        self.peer_calls = 0                      # fires that took the P2P path (tests, tools)
        self._side = None                        # abort's stream

    def bind(self, cl):
        if cl.op in ("all_reduce", "ep_combine") and "p2p" in cl.helpers:
            return self._peer_sum(cl, super().bind(cl))
        return super().bind(cl)

    def _peer_sum(self, cl, nccl_fire):
        x, out = cl.inputs[0], cl.outputs[0]
        kernel = cl.helper("p2p")
        if kernel.meta.get("max_programs", MAX_PROGRAMS + 1) > MAX_PROGRAMS:
            raise ValueError(f"{cl.where}: peer_sum kernel {kernel.id} may run "
                             f"{kernel.meta.get('max_programs', 'unbounded')} programs; the regions "
                             f"have flags for {MAX_PROGRAMS} (rebuild the artifact)")
        L = self.layout
        slot = L.slot_elems(x.itemsize)
        ins = [x.ptr, self.local + L.stage, *[r + L.stage for r in self.regions],
               self.local + L.flags, *[r + L.flags for r in self.regions],
               self.local + L.counter, self.local + L.err]
        peer_sum = bound_helper(self.ctx, kernel, ins, [out.ptr], {"rank": self.rank, "slot_elems": slot})

        def fire(dims):
            n = x.numel(dims)
            if not n:
                return
            if n > slot:
                nccl_fire(dims)                  # every rank sees the same n: the same choice
                return
            self.peer_calls += 1
            peer_sum(dims)
        return fire

    def abort(self):
        """Free a peer_sum waiting for a dead rank (every flag of this region raised from a side
        stream: its wait ends), then abort the NCCL communicator."""
        try:
            self.ctx.ensure_current()
            if self._side is None:
                flag = cu.CUstream_flags.CU_STREAM_NON_BLOCKING
                self._side = check(cu.cuStreamCreate(flag), "cuStreamCreate")
            check(cu.cuMemsetD8Async(self.local + self.layout.flags, 0x7F, self.layout.counter,
                                     self._side), "cuMemsetD8Async")
        finally:
            super().abort()

    def errors(self) -> int:
        """peer_sum's error word: 1 once a wait gave up."""
        out = np.zeros(1, np.int32)
        if self.ctx.stream is not None:
            self.ctx.dtoh(out, self.local + self.layout.err)
            self.ctx.sync()
        else:                                   # after ctx.close() (CudaRunner.close runs it first)
            check(cu.cuMemcpyDtoH(out.ctypes.data, self.local + self.layout.err, 4), "cuMemcpyDtoH")
        return int(out[0])

    def close(self, graceful: bool = True, timeout: float = 10.0):
        try:
            self.ctx.ensure_current()
            if graceful and self.errors():
                sys.stderr.write(f"infc rank {self.rank}: a one-shot all-reduce gave up waiting "
                                 f"for a peer; its results were wrong\n")
            for p in self._opened:
                ipc_close(p)
            self._opened = []
            if self._free_local and self.local:
                _free_region(self.local)
                self.local = 0
        except Exception as e:               # noqa: BLE001 - the communicator is released anyway
            sys.stderr.write(f"infc rank {self.rank}: releasing the P2P regions failed: {e}\n")
        super().close(graceful, timeout)
