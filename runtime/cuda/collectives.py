"""Collectives in the CUDA runner: how a rank plan's collective launches run on the GPU.

A collective launch (compiler/ops/collectives.py: all_reduce, all_gather, ep_dispatch,
ep_combine; backend "nccl", no kernel of its own) is bound by the runner (runner.bind) into a
CollectiveLaunch (its buffers' device pointers, shapes and dtypes, and the helper kernels the
build rendered for it: compiler/codegen/rank_kernels.py), which the runner's `Collectives` turns
into fire(dims), called in launch order on the runner's stream. Two implementations:

NcclCollectives: one communicator per process and GPU (runtime/cuda/nccl.py), every collective
    enqueued on the runner's stream, so a CUDA Graph captured there records it.
      all_reduce, ep_combine   ncclAllReduce (the sum at the token's owner shared with every rank
                               is the all-reduce; NCCL picks the order of the sum, every rank
                               gets the same bits); fp32 partials with a bf16 output are
                               reduced in fp32 and rounded once by the `cast` helper (large
                               ones as reduce-scatter, cast, all-gather of the bf16 shares)
      all_gather               ncclAllGather (axis 0), or into a staging buffer and then
                               strided copies into place (another axis)
      dp_dispatch              ncclAllGather of x, weights and ids into G-row staging buffers,
                               then the `select` helper masks them to this rank's experts
      dp_combine               ncclReduceScatter: rank r's block of every rank's G rows, summed
      ep_dispatch              replicated (every mode built so far): the ep_dispatch kernel
                               (mode "nccl") selects and masks this rank's own x, no traffic;
                               otherwise each rank's own rows (token t is owned by rank t % N)
                               packed, ncclAllGather, unpacked into a [T, H] of the owners'
                               rows, then that kernel
DeviceCopyCollectives: the N ranks' runners in ONE process on ONE GPU, sharing one Context (one
    stream), each rank one member of a DeviceCopyGroup. A rank's fire() only hands its buffers in;
    when the last rank has arrived (the lockstep driver, runtime/cuda/ranks.py, runs the ranks
    segment by segment between collectives), the group issues the collective for all ranks:
      all_reduce, ep_combine   rank_sum: out_r = x_0 + ... + x_{N-1} in fp32, rank order, one
                               rounding (the numpy reference's bits, the same on every rank)
      all_gather               device-to-device copies (strided for an axis other than 0)
      ep_dispatch              the ep_dispatch kernel (mode "device_copy") per rank, reading each
                               row from its owner's buffer
      dp_dispatch              every rank's x, weights and ids copied into one G-row staging set,
                               then the `select` helper per rank
      dp_combine               rank_sum per rank r over every rank's block r (rank order)
    Exactly the numpy references (compiler/ops/collectives.py), owner convention included.
P2PCollectives (runtime/cuda/p2p.py): NcclCollectives whose small all_reduce / ep_combine (up to
    64 KiB) are a one-shot sum over the ranks' memory mapped into each other (CUDA IPC), the
    reference's bits.
"""
from dataclasses import dataclass

import numpy as np

from infc import envs
from infc.compiler.contract.bind import Resolver, dim_slots, eval_int, grid
from infc.compiler.contract.schema import DTYPE_BYTES
from .driver import check, cu, launch


@dataclass
class Buffer:
    """One activation of a collective launch: its device pointer, shape (T/B symbolic), dtype."""
    name: str
    ptr: int
    shape: list
    dtype: str

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def numel(self, dims: dict, start: int = 0, stop: int | None = None) -> int:
        n = 1
        for d in self.shape[start:stop]:
            n *= eval_int(d, dims)
        return n

    def nbytes(self, dims: dict) -> int:
        return self.numel(dims) * self.itemsize


@dataclass
class CollectiveLaunch:
    op: str
    attrs: dict
    inputs: list
    outputs: list
    helpers: dict            # mode ("device_copy" / "nccl") -> the loaded helper kernel
    layer: int | None
    place: dict              # the dims the runner's buffers are laid out for (max T, max B)
    where: str = ""

    def helper(self, mode: str):
        if mode not in self.helpers:
            raise RuntimeError(f"{self.where}: {self.op} has no '{mode}' helper kernel in this "
                               f"artifact (built before runtime collectives): rebuild it")
        return self.helpers[mode]


def bind_collective(runner, launch: dict, layer):
    """The runner's bound entry for a collective launch: fire(dims)."""
    coll = runner.collectives
    plan = runner.plan
    par = plan.get("parallel") or {"world": 1, "rank": 0}
    where = f"{launch['op']} (layer {layer})" if layer is not None else launch["op"]
    if coll is None:
        raise RuntimeError(f"this plan is rank {par['rank']} of {par['world']} and has collective "
                           f"launches ({where}): give the runner collectives= (runtime/cuda/"
                           f"collectives.py: NcclCollectives, or runtime/cuda/ranks.py's "
                           f"DeviceCopyRanks for every rank on one GPU)")
    if (coll.world, coll.rank) != (par["world"], par["rank"]):
        raise ValueError(f"the plan is rank {par['rank']} of {par['world']}, its collectives are "
                         f"rank {coll.rank} of {coll.world}")

    def buf(name):
        b = plan["buffers"][name]
        if "row_stride" in b:
            raise NotImplementedError(f"{where}: '{name}' is a strided view; collectives take "
                                      f"contiguous buffers")
        return Buffer(name, runner._buffer_ptr(name), list(b["shape"]), b["dtype"])

    helpers = {mode: runner.kernels[kid] for mode, kid in launch.get("helpers", {}).items()}
    cl = CollectiveLaunch(launch["op"], dict(launch["attrs"]), [buf(n) for n in launch["inputs"]],
                          [buf(n) for n in launch["outputs"]], helpers, layer, dict(runner.place),
                          where)
    return coll.bind(cl)


# -- device operations (the CPU tests swap _memcpy2d and launch for fakes) --------------------------
def _memcpy2d(ctx, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int):
    c = cu.CUDA_MEMCPY2D()
    c.srcMemoryType = cu.CUmemorytype.CU_MEMORYTYPE_DEVICE
    c.srcDevice = src
    c.srcPitch = spitch
    c.dstMemoryType = cu.CUmemorytype.CU_MEMORYTYPE_DEVICE
    c.dstDevice = dst
    c.dstPitch = dpitch
    c.WidthInBytes = width
    c.Height = height
    check(cu.cuMemcpy2DAsync(c, ctx.stream), "cuMemcpy2DAsync")


def copy_2d(ctx, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int):
    """`height` rows of `width` bytes, rows `spitch` bytes apart at src, `dpitch` apart at dst."""
    if width <= 0 or height <= 0:
        return
    if height == 1 or dpitch == spitch == width:
        ctx.dtod(dst, src, width * height)             # one run of bytes
        return
    _memcpy2d(ctx, dst, dpitch, src, spitch, width, height)


def run_helper(ctx, kernel, ins: list[int], outs: list[int], dims: dict, args: dict | None = None):
    """Launch a helper kernel on pointers: its META's in:i / out:i bind ins[i] / outs[i]."""
    bound_helper(ctx, kernel, ins, outs, args)(dims)


def bound_helper(ctx, kernel, ins: list[int], outs: list[int], args: dict | None = None):
    """run_helper with its pointers and named arguments packed once: fire(dims) rewrites only the
    dim parameters and the grid (an eager step fires a collective per sublayer; resolving and
    packing each time cost tens of microseconds a call in Python)."""
    ptrs = {**{f"in{i}": p for i, p in enumerate(ins)}, **{f"out{i}": p for i, p in enumerate(outs)}}
    values = Resolver(tensor=lambda name, layer: ptrs[name], dim=lambda name: 0,
                      arg=(args or {}).__getitem__).values(
        kernel.meta, [f"in{i}" for i in range(len(ins))], [f"out{i}" for i in range(len(outs))],
        kernel=kernel.id)
    packed = kernel.pack(values)
    slots = dim_slots(kernel.meta)

    def fire(dims: dict):
        g = grid(kernel.meta, dims)
        if g[0] * g[1] * g[2] == 0:
            return
        for i, name in slots:
            packed.set(i, dims[name])
        launch(ctx, kernel.fn, g, kernel.block, kernel.shared, packed)
    return fire


def _gather_geometry(x: Buffer, axis: int, dims: dict) -> tuple[int, int]:
    """(rows, bytes per row) of x seen as [prod(shape[:axis]), prod(shape[axis:])]."""
    return x.numel(dims, 0, axis), x.numel(dims, axis) * x.itemsize


def owned_rows(T: int, rank: int, world: int) -> int:
    """How many of T token rows rank `rank` owns (token t is owned by rank t % world)."""
    return len(range(rank, T, world))


class Collectives:
    """A rank's way to run its plan's collectives: bind(CollectiveLaunch) -> fire(dims)."""
    world = 1
    rank = 0

    def bind(self, cl: CollectiveLaunch):
        raise NotImplementedError


class NcclCollectives(Collectives):
    """Collectives over an NCCL communicator (runtime/cuda/nccl.Communicator), on ctx's stream."""

    # fp32 partials of at most this many bytes are all-reduced whole (one NCCL call, latency-
    # bound below ~1 MB: bench allreduce, 655 KB in 11 us, 1.3 MB in 15 us on 2 x H100); larger
    # ones go as reduce-scatter + all-gather (fewer bytes, one more call)
    rs_ag_bytes = 1 << 20

    def __init__(self, comm, ctx):
        self.comm, self.ctx = comm, ctx
        self.world, self.rank = comm.world, comm.rank
        self._staging: dict[str, tuple[int, int]] = {}

    def abort(self):
        """Abort the communicator now (the rank watchdog's way out of a collective waiting for a
        dead rank: runtime/distributed/rank_workers.py)."""
        self.comm.abort()

    def close(self, graceful: bool = True, timeout: float = 10.0):
        """Release the communicator: ncclCommDestroy when every rank closes together (graceful),
        ncclCommAbort when a peer is gone or failed. Either runs in a daemon thread waited on for
        `timeout` s: a teardown that waits on a peer which never comes (the first two-GPU runs
        saw closes take over 80 s) is left behind with a warning rather than hanging the caller."""
        import sys
        import threading
        import time
        what, release = ("destroy", self.comm.destroy) if graceful else ("abort", self.comm.abort)
        done = threading.Event()

        def run():
            try:
                release()
            except Exception as e:           # noqa: BLE001 - reported, the close goes on
                sys.stderr.write(f"infc rank {self.rank}: NCCL {what} failed: {e}\n")
            done.set()
        t0 = time.monotonic()
        threading.Thread(target=run, name="infc-nccl-release", daemon=True).start()
        if not done.wait(timeout):
            sys.stderr.write(f"infc rank {self.rank}: NCCL {what} did not finish in {timeout:.0f} s; "
                             f"left behind\n")
        elif time.monotonic() - t0 > 1.0:
            sys.stderr.write(f"infc rank {self.rank}: NCCL {what} took {time.monotonic() - t0:.1f} s\n")

    def _alloc(self, role: str, nbytes: int) -> int:
        """A staging buffer of at least nbytes, shared by every launch (of every phase and layer)
        that uses `role`: the collectives run one after another on the stream."""
        ptr, size = self._staging.get(role, (0, -1))
        if size < nbytes:
            ptr = self.ctx.alloc(max(int(nbytes), 1))
            self._staging[role] = (ptr, nbytes)
        return ptr

    def bind(self, cl: CollectiveLaunch):
        if cl.op in ("all_reduce", "ep_combine"):
            x, out = cl.inputs[0], cl.outputs[0]
            if x.dtype != out.dtype:
                return self._reduce_and_round(cl)

            def fire(dims):
                n = x.numel(dims)
                if n:
                    self.comm.all_reduce(x.ptr, out.ptr, n, x.dtype, self.ctx.stream)
            return fire
        if cl.op == "all_gather":
            return self._all_gather(cl)
        if cl.op == "ep_dispatch":
            return self._dispatch(cl)
        if cl.op == "dp_dispatch":
            return self._dp_dispatch(cl)
        if cl.op == "dp_combine":
            y, out = cl.inputs[0], cl.outputs[0]

            def fire_combine(dims):
                n = out.numel(dims)              # this rank's T rows; y holds world * T
                if n:
                    self.comm.reduce_scatter(y.ptr, out.ptr, n, y.dtype, self.ctx.stream)
            return fire_combine
        raise NotImplementedError(f"{cl.where}: no NCCL implementation of collective '{cl.op}'")

    def _reduce_and_round(self, cl):
        """fp32 partials in, bf16 out (a row-parallel linear's partial sums): the sum in fp32,
        rounded once by the `cast` helper. Up to rs_ag_bytes of partials: one all-reduce in place
        (x is read by nothing else) and the cast. Above, where the ranks split the elements
        evenly: a reduce-scatter of the fp32 partials, this rank's share rounded, an all-gather of
        the bf16 shares (each rank's share summed and rounded once, by one rank: every rank gets
        the same bits), which moves 3 bytes an element where the fp32 all-reduce moves 4 (and a
        bf16 one 2): prefill's all-reduces are bandwidth-bound."""
        x, out, N = cl.inputs[0], cl.outputs[0], self.world
        cast_kernel = cl.helper("cast")
        whole = bound_helper(self.ctx, cast_kernel, [x.ptr], [out.ptr])
        share_max = -(-x.numel(cl.place) // N)
        reduced = self._alloc("rs-f32", share_max * x.itemsize)
        rounded = self._alloc("rs-out", share_max * out.itemsize)
        share = bound_helper(self.ctx, cast_kernel, [reduced], [rounded])

        def fire(dims):
            n = x.numel(dims)
            if not n:
                return
            if n * x.itemsize <= self.rs_ag_bytes or n % N:
                self.comm.all_reduce(x.ptr, x.ptr, n, x.dtype, self.ctx.stream)
                whole({"T": n})
                return
            self.comm.reduce_scatter(x.ptr, reduced, n // N, x.dtype, self.ctx.stream)
            share({"T": n // N})
            self.comm.all_gather(rounded, out.ptr, n // N, out.dtype, self.ctx.stream)
        return fire

    def _all_gather(self, cl):
        x, out, axis, N = cl.inputs[0], cl.outputs[0], cl.attrs["axis"], self.world
        staging = self._alloc("gather", N * x.nbytes(cl.place)) if axis else 0

        def fire(dims):
            n = x.numel(dims)
            if not n:
                return
            if not axis:                              # rank r's rows land at block r: in place
                self.comm.all_gather(x.ptr, out.ptr, n, x.dtype, self.ctx.stream)
                return
            self.comm.all_gather(x.ptr, staging, n, x.dtype, self.ctx.stream)
            rows, row = _gather_geometry(x, axis, dims)
            for r in range(N):                         # [N, rows, row] -> [rows, N, row]
                copy_2d(self.ctx, out.ptr + r * row, N * row, staging + r * rows * row, row, row, rows)
        return fire

    def _dp_dispatch(self, cl):
        """Every rank's rows of x, weights and ids gathered (rank r's at rows r * T ..), then
        masked to this rank's experts by the select helper."""
        N = self.world
        stages = [self._alloc(f"dp-{i}", N * b.nbytes(cl.place)) for i, b in enumerate(cl.inputs)]
        select = bound_helper(self.ctx, cl.helper("select"), stages, [o.ptr for o in cl.outputs],
                              {"rank": self.rank})

        def fire(dims):
            if not eval_int(cl.inputs[0].shape[0], dims):
                return
            for b, stage in zip(cl.inputs, stages):
                self.comm.all_gather(b.ptr, stage, b.numel(dims), b.dtype, self.ctx.stream)
            select(dims)
        return fire

    def _dispatch(self, cl):
        x, w, ids = cl.inputs
        N, rank = self.world, self.rank
        kernel = cl.helper("nccl")
        if cl.attrs.get("replicated") and not envs.value("INFC_EP_GATHER"):
            # every rank holds every row (compiler/ops/collectives.py): select from x, no gather
            # (INFC_EP_GATHER=1 gathers the owners' rows anyway: the A/B switch)
            local = bound_helper(self.ctx, kernel, [x.ptr, w.ptr, ids.ptr], [o.ptr for o in cl.outputs],
                                 {"rank": rank})

            def fire_local(dims):
                if eval_int(x.shape[0], dims):
                    local(dims)
            return fire_local
        row = x.numel(cl.place, 1) * x.itemsize
        t_max = eval_int(x.shape[0], cl.place)
        m_max = -(-t_max // N)
        send, gathered = self._alloc("send", m_max * row), self._alloc("gathered", N * m_max * row)
        full = self._alloc("full", t_max * row)
        select = bound_helper(self.ctx, kernel, [full, w.ptr, ids.ptr], [o.ptr for o in cl.outputs],
                              {"rank": rank})

        def fire(dims):
            T = eval_int(x.shape[0], dims)
            if not T:
                return
            M = -(-T // N)
            # my rows t = rank, rank + N, ... -> send[0 .. owned-1]
            copy_2d(self.ctx, send, row, x.ptr + rank * row, N * row, row, owned_rows(T, rank, N))
            self.comm.all_gather(send, gathered, M * row // x.itemsize, x.dtype, self.ctx.stream)
            for q in range(N):                         # rank q's block -> rows q, q + N, ...
                copy_2d(self.ctx, full + q * row, N * row, gathered + q * M * row, row, row,
                        owned_rows(T, q, N))
            select(dims)
        return fire


def _shared_dims(op: str, dims: dict) -> dict:
    """The dims every rank's launch of collective `op` agrees on: all of them, but a data-parallel
    rank runs its own sequences (the same T, padded; its own B)."""
    return {k: v for k, v in dims.items() if k != "B"} if op.startswith("dp_") else dims


class DeviceCopyGroup:
    """The N ranks of a parallel plan on one GPU in one process: collectives by device copies and
    the helper kernels, issued once every rank has handed its buffers in (rank order)."""

    def __init__(self, ctx, world: int):
        self.ctx, self.world = ctx, world
        self.waiting: list[tuple] = []
        self.issued = 0                   # collectives issued (tests)
        self.stages: list[list] = []       # dp_dispatch's gathered x, weights, ids: [ptr, bytes]
        self.observe = None               # observe(op, [CollectiveLaunch per rank], dims): tests

    def stage(self, i: int, nbytes: int) -> int:
        """dp_dispatch's staging buffer for input i, shared by every layer's launch (they run one
        after another) and grown to the largest asked for."""
        while len(self.stages) <= i:
            self.stages.append([0, -1])
        if self.stages[i][1] < nbytes:
            self.stages[i] = [self.ctx.alloc(max(int(nbytes), 1)), nbytes]
        return self.stages[i][0]

    def member(self, rank: int) -> "DeviceCopyCollectives":
        return DeviceCopyCollectives(self, rank)

    def arrive(self, rank: int, cl: CollectiveLaunch, dims: dict):
        if rank != len(self.waiting):
            raise RuntimeError(f"ranks out of lockstep: rank {rank} reached {cl.where} while "
                               f"{len(self.waiting)} of {self.world} ranks were waiting (the ranks "
                               f"must run segment by segment: runtime/cuda/ranks.py)")
        if self.waiting:
            first, d0 = self.waiting[0]
            if (cl.op, cl.attrs, cl.layer) != (first.op, first.attrs, first.layer) or \
                    _shared_dims(cl.op, dims) != _shared_dims(cl.op, d0):
                raise RuntimeError(f"ranks diverge: rank 0 is at {first.where} {d0}, rank {rank} at "
                                   f"{cl.where} {dims}")
        self.waiting.append((cl, dict(dims)))
        if len(self.waiting) == self.world:
            cls = [c for c, _ in self.waiting]
            self.waiting = []
            self.run(cls, dims)

    def run(self, cls: list, dims: dict):
        op = cls[0].op
        if op in ("all_reduce", "ep_combine"):
            run_helper(self.ctx, cls[0].helper("device_copy"), [c.inputs[0].ptr for c in cls],
                       [c.outputs[0].ptr for c in cls], dims)
        elif op == "all_gather":
            self._gather(cls, dims)
        elif op == "ep_dispatch":
            for r, c in enumerate(cls):
                run_helper(self.ctx, c.helper("device_copy"),
                           [d.inputs[0].ptr for d in cls] + [c.inputs[1].ptr, c.inputs[2].ptr],
                           [o.ptr for o in c.outputs], dims, {"rank": r})
        elif op == "dp_dispatch":
            stages = [s for s, _ in self.stages[:len(cls[0].inputs)]]
            for i, stage in enumerate(stages):        # rank q's rows at rows q * T ..
                for q, c in enumerate(cls):
                    n = c.inputs[i].nbytes(dims)
                    self.ctx.dtod(stage + q * n, c.inputs[i].ptr, n)
            for r, c in enumerate(cls):
                run_helper(self.ctx, c.helper("select"), stages, [o.ptr for o in c.outputs], dims, {"rank": r})
        elif op == "dp_combine":
            for r, c in enumerate(cls):               # rank r's block of every rank's rows
                share = c.outputs[0].numel(dims) * cls[0].inputs[0].itemsize
                run_helper(self.ctx, c.helper("device_copy"), [d.inputs[0].ptr + r * share for d in cls],
                           [c.outputs[0].ptr] * self.world, dims)
        else:
            raise NotImplementedError(f"{cls[0].where}: no device-copy implementation of '{op}'")
        self.issued += 1
        if self.observe is not None:
            self.observe(op, cls, dims)

    def _gather(self, cls, dims):
        N, axis = self.world, cls[0].attrs["axis"]
        rows, row = _gather_geometry(cls[0].inputs[0], axis, dims)
        for d in cls:                       # every rank's out: [rows, N, row] (rank order)
            for r, s in enumerate(cls):
                copy_2d(self.ctx, d.outputs[0].ptr + r * row, N * row, s.inputs[0].ptr, row, row, rows)


class DeviceCopyCollectives(Collectives):
    """Rank `rank`'s member of a DeviceCopyGroup."""

    def __init__(self, group: DeviceCopyGroup, rank: int):
        self.group, self.rank, self.world = group, rank, group.world

    def bind(self, cl: CollectiveLaunch):
        if cl.op in ("all_reduce", "ep_combine", "ep_dispatch", "dp_combine"):
            cl.helper("device_copy")             # an artifact without it fails at bind, not mid-step
        if cl.op == "dp_dispatch":
            cl.helper("select")
            for i, b in enumerate(cl.inputs):        # laid out for the max T, before any capture
                self.group.stage(i, self.world * b.nbytes(cl.place))
        return lambda dims: self.group.arrive(self.rank, cl, dims)


def agreed_min(comm, ctx, n: int) -> int:
    """The smallest of every rank's n (an NCCL all-reduce of one int32 on ctx's stream)."""
    buf = ctx.alloc(4)
    try:
        keep = ctx.htod(buf, np.asarray([n], np.int32))
        comm.all_reduce(buf, buf, 1, "i32", ctx.stream, op="min")
        out = np.empty(1, np.int32)
        ctx.dtoh(out, buf)
        ctx.sync()
        del keep
        return int(out[0])
    finally:
        ctx.free(buf)
