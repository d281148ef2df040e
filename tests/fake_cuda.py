"""A fake CUDA driver for the CPU tests: a stand-in for infc.runtime.cuda.driver (its Context,
Event, Module, Graph, launch and DependentLaunch; PackedArgs stays the real, pure-ctypes one), so
the CUDA runner, the profiler, the tuner, the caches and the device weight loader run without a
GPU or cuda-python.

What it simulates
- Device memory: each allocation is a numpy uint8 array, poisoned with 0xAB when made (an unwritten
  byte shows). A device pointer is the host address of the allocation's first byte, 256-aligned,
  so pointer arithmetic, the real PackedArgs and copies from a host address (htod_raw) work as on
  a GPU. Every copy and memset must stay inside one live allocation (else AssertionError).
  `ctx.read(ptr, n)` and `ctx.view(ptr, count, dtype)` let a test (or a fake kernel) read and
  write device memory. mem_info() reports `memory` bytes (1 GiB unless told) less what is
  allocated; an allocation past that raises MemoryError. Pinned memory: numpy arrays,
  `ctx.pinned_live` lists those not given back; pinned(mapped=True) memory is device memory too, at
  the same address (device_ptr), as under UVA, and counts in no budget.
- One synchronous stream: a copy, memset or launch takes effect when it is issued; sync() counts.
- Launches: each is recorded in `driver.launches` as a Launch (function, grid, block, shared
  bytes, the argument values as packed at launch time), then run by `driver.on_launch(launch)`,
  which may write device memory and returns the microseconds the launch takes (None: 0). Without
  a callback, a function whose "cubin" is a rendered Triton source runs under Triton's
  interpreter on the fake memory (`Launch.run_triton()`, which a callback may call too); any other
  function does nothing.
- Events read a virtual clock (ms) that each launch advances by its time; `ctx.num_events`,
  `ctx.num_syncs` and `ctx.num_copies` (every copy: htod*, dtoh, dtod) count what was made and done.
- Graphs: Graph(ctx, record) keeps the launches record() issues, with their argument values at
  capture time (as CUDA does), without running them; graph.launch() runs them again (recorded
  with replay=True). A DependentLaunch (PDL) is a plain launch recorded with dependent=True.
- Module(cubin): a "cubin" is any bytes, kept on each of its functions (`fn.cubin`) for the
  callback to read: e.g. JSON that says what the fake kernel writes and how long it takes.

What it does not
- No concurrency or asynchrony (no copy/compute overlap, nothing to wait for), no real timing,
  no GPU numerics: a kernel computes only what the callback or the interpreter does.
- No CUDA error codes: misuse (a bad pointer, a copy or sync while capturing, a double free)
  fails an assertion instead of raising CudaError; cuda.bindings itself is not faked, so code that
  calls it directly (driver.check, tune_run._l2_bytes without ctx.l2_bytes) is not covered.
- Device attributes: name, sm_count, cc and l2_bytes only (a small L2: 16 MiB).

Use
- The `fake_driver` fixture (tests/conftest.py) installs a FakeDriver for one test and gives it to
  the test: infc.runtime.cuda.driver's names, and the same names wherever an infc module imported
  them (runner, sampler, artifact, ...), are the fake's; `from infc.runtime.cuda import runner`
  inside the test then runs on it, and the driver can be passed where code takes one
  (tune_run.run(driver=...)). Set `fake_driver.on_launch` to give kernels their effect and time;
  a rendered kernel becomes launchable as KernelFn(id, meta, info,
  fake_driver.Module(source).function(meta["entry"])). Where cuda-python is missing, a stand-in
  cuda.bindings makes those modules importable; afterwards it and the infc.runtime.cuda modules
  first imported during the test are dropped, so later tests see no CUDA.
- FakeContext() alone where only a context is needed (DeviceWeights' streaming, DeviceCaches).
"""
import bisect
import ctypes
import dataclasses
import hashlib
import importlib
import sys
import types
from contextlib import contextmanager

import numpy as np

POISON = 0xAB
ALIGN = 256


class FakeContext:
    """driver.Context over numpy memory (see the module docstring)."""

    def __init__(self, device: int = 0, name: str = "NVIDIA H200 (fake)", memory: int = 1 << 30,
                 l2_bytes: int = 16 << 20, sm_count: int = 132, cc=(9, 0)):
        self.device, self.name, self.memory, self.l2_bytes = device, name, memory, l2_bytes
        self.sm_count, self.cc, self.stream = sm_count, tuple(cc), object()
        self._bases: list[int] = []            # sorted allocation addresses
        self._allocs: dict[int, np.ndarray] = {}
        self._mapped: dict[int, np.ndarray] = {}   # pinned(mapped=True): device-reachable host memory
        self.pinned_live: list[np.ndarray] = []
        self.clock = 0.0                       # ms, advanced by launches
        self.capturing = None                  # the launches of a graph being captured
        self.num_events = self.num_syncs = self.num_copies = 0

    # -- memory ------------------------------------------------------------------------------
    def allocated(self) -> int:
        return sum(a.size for a in self._allocs.values())

    def mem_info(self) -> tuple[int, int]:
        return self.memory - self.allocated(), self.memory

    def alloc(self, nbytes: int) -> int:
        n = max(int(nbytes), 1)
        if self.allocated() + n > self.memory:
            raise MemoryError(f"fake CUDA: {n} bytes do not fit ({self.mem_info()[0]} of {self.memory} free)")
        owner = np.empty(n + ALIGN, np.uint8)
        a = owner[-owner.ctypes.data % ALIGN:][:n]       # keeps owner alive
        a.fill(POISON)
        ptr = a.ctypes.data
        bisect.insort(self._bases, ptr)
        self._allocs[ptr] = a
        return ptr

    def free(self, ptr: int):
        assert ptr in self._allocs, f"fake CUDA: free of {ptr:#x}, not an allocation"
        self._bases.remove(ptr)
        del self._allocs[ptr]

    def rest(self, ptr: int) -> np.ndarray:
        """The bytes from ptr to the end of its live allocation, as a writable view."""
        i = bisect.bisect_right(self._bases, ptr) - 1
        a = (self._allocs.get(self._bases[i]) if self._bases[i] in self._allocs
             else self._mapped[self._bases[i]]) if i >= 0 else None
        assert a is not None and ptr < self._bases[i] + a.size, f"fake CUDA: {ptr:#x} is in no live allocation"
        return a[ptr - self._bases[i]:]

    def _span(self, ptr: int, nbytes: int) -> np.ndarray:
        """The bytes [ptr, ptr + nbytes) of one live allocation, as a writable view."""
        rest = self.rest(ptr)
        assert nbytes <= rest.size, f"fake CUDA: {nbytes} bytes at {ptr:#x} run past their allocation"
        return rest[:nbytes]

    def read(self, ptr: int, nbytes: int) -> bytes:
        return self._span(ptr, nbytes).tobytes()

    def view(self, ptr: int, count: int, dtype=np.uint8) -> np.ndarray:
        """count elements of dtype at ptr: a writable view of device memory."""
        dtype = np.dtype(dtype)
        return self._span(ptr, count * dtype.itemsize).view(dtype)

    def _issue(self, what: str):
        assert self.capturing is None, f"fake CUDA: {what} while capturing a graph (it captures launches only)"

    def memset(self, ptr: int, nbytes: int, value: int = 0):
        self._issue("memset")
        self._span(ptr, nbytes)[:] = value

    def memset32(self, ptr: int, count: int, value: int):
        self._issue("memset32")
        self.view(ptr, count, np.uint32)[:] = value

    def htod(self, ptr: int, host: np.ndarray):
        self._issue("htod")
        host = np.ascontiguousarray(host)
        self._span(ptr, host.nbytes)[:] = host.reshape(-1).view(np.uint8)
        self.num_copies += 1
        return host

    def htod_rows(self, ptr: int, pitch: int, host: np.ndarray):
        """host [rows, w] into the first w bytes of rows `pitch` bytes apart (the rest untouched)."""
        self._issue("htod_rows")
        host = np.ascontiguousarray(host)
        rows = host.shape[0]
        if host.nbytes == 0:
            return host
        row_bytes = host.nbytes // rows
        assert row_bytes <= pitch, (row_bytes, pitch)
        raw = host.reshape(rows, -1).view(np.uint8)
        for r in range(rows):
            self._span(ptr + r * pitch, row_bytes)[:] = raw[r]
        self.num_copies += 1
        return host

    def htod_raw(self, ptr: int, host_addr: int, nbytes: int, stream=None):
        self._issue("htod_raw")
        dst = self._span(ptr, nbytes)
        ctypes.memmove(dst.ctypes.data, host_addr, nbytes)
        self.num_copies += 1

    def dtoh_raw(self, host_addr: int, ptr: int, nbytes: int, stream=None):
        self._issue("dtoh_raw")
        ctypes.memmove(host_addr, self._span(ptr, nbytes).ctypes.data, nbytes)
        self.num_copies += 1

    def dtoh(self, host: np.ndarray, ptr: int) -> np.ndarray:
        self._issue("dtoh")
        assert host.flags.c_contiguous, "fake CUDA: dtoh into a non-contiguous array"
        host.reshape(-1).view(np.uint8)[:] = self._span(ptr, host.nbytes)
        self.num_copies += 1
        return host

    def dtod(self, dst: int, src: int, nbytes: int):
        self._issue("dtod")
        self._span(dst, nbytes)[:] = self._span(src, nbytes)
        self.num_copies += 1

    def memcpy2d(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int):
        """cuMemcpy2DAsync between device pointers: `height` rows of `width` bytes, `spitch` bytes
        apart at src, `dpitch` apart at dst (the driver module has no such call: code that issues
        it through cuda.bindings, e.g. collectives._memcpy2d, can be pointed here)."""
        self._issue("memcpy2d")
        for r in range(height):
            self._span(dst + r * dpitch, width)[:] = self._span(src + r * spitch, width)
        self.num_copies += 1

    def copy2d(self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int,
               to_host: bool, stream=None):
        """driver.Context.copy2d: rows between device memory (checked as any copy) and host
        memory at a raw address (a pinned array's)."""
        self._issue("copy2d")
        for r in range(height):
            d, s = dst + r * dst_pitch, src + r * src_pitch
            if to_host:
                ctypes.memmove(d, self._span(s, width).ctypes.data, width)
            else:
                ctypes.memmove(self._span(d, width).ctypes.data, s, width)
        self.num_copies += 1

    def new_stream(self):
        """Another stream: the fake has one timeline, so it is a name only."""
        return object()

    def wait_event(self, event, stream=None):
        assert event.t is not None, "fake CUDA: a stream waits for an event never recorded"

    def pinned(self, nbytes: int, mapped: bool = False) -> np.ndarray:
        """mapped: also device memory at the same address (as under UVA), so fake kernels and
        device copies reach it; it counts in no device budget."""
        if not mapped:
            a = np.zeros(nbytes, np.uint8)
        else:
            owner = np.zeros(nbytes + ALIGN, np.uint8)
            a = owner[-owner.ctypes.data % ALIGN:][:nbytes]
            bisect.insort(self._bases, a.ctypes.data)
            self._mapped[a.ctypes.data] = a
        self.pinned_live.append(a)
        return a

    def device_ptr(self, host: np.ndarray) -> int:
        assert host.ctypes.data in self._mapped, "fake CUDA: device_ptr of memory not pinned mapped"
        return host.ctypes.data

    def free_pinned(self, host: np.ndarray):
        assert any(a is host for a in self.pinned_live), "fake CUDA: free_pinned of memory not pinned here"
        self.pinned_live = [a for a in self.pinned_live if a is not host]
        if self._mapped.pop(host.ctypes.data, None) is not None:
            self._bases.remove(host.ctypes.data)

    # -- the stream ----------------------------------------------------------------------------
    def ensure_current(self):
        pass

    def sync(self, stream=None):
        if stream is not None:                   # another stream's copies: the fake ran them at once
            return
        self._issue("sync")
        self.num_syncs += 1

    def event(self) -> "FakeEvent":
        return FakeEvent(self)

    def close(self):
        for ptr in list(self._allocs):
            self.free(ptr)
        for ptr in list(self._mapped):
            self._bases.remove(ptr)
        self.pinned_live, self.stream, self._mapped = [], None, {}


class FakeEvent:
    """An event that reads its context's virtual clock."""

    def __init__(self, ctx: FakeContext):
        self.ctx, self.t = ctx, None
        ctx.num_events += 1

    def record(self, stream=None):
        self.ctx._issue("event record")
        self.t = self.ctx.clock

    def wait(self):
        assert self.t is not None, "fake CUDA: wait on an event never recorded"

    def ms_since(self, start: "FakeEvent") -> float:
        assert self.t is not None and start.t is not None, "fake CUDA: an event was never recorded"
        return self.t - start.t


@dataclasses.dataclass(eq=False)
class FakeFunction:
    """A kernel function of a fake module: its name and the module's bytes."""
    name: str
    cubin: bytes
    shared: int = 0

    @property
    def is_triton(self) -> bool:
        return b"@triton.jit" in self.cubin


class FakeModule:
    def __init__(self, cubin: bytes):
        self.cubin = bytes(cubin)

    def function(self, name: str, shared: int = 0) -> FakeFunction:
        return FakeFunction(name, self.cubin, shared)


@dataclasses.dataclass(eq=False)
class Launch:
    """One kernel launch as the fake driver saw it."""
    ctx: FakeContext
    fn: object                 # what the caller launched: a FakeFunction, or whatever it passed
    grid: tuple
    block: tuple
    shared: int
    values: tuple              # the argument values as packed when launched (or captured)
    replay: bool = False       # run by a graph's replay
    dependent: bool = False    # issued through a DependentLaunch (PDL)

    def run_triton(self) -> None:
        """Run the launch's rendered Triton kernel (the function's "cubin" is its source) under
        Triton's interpreter on the fake memory: each pointer parameter becomes a tensor over
        the rest of its allocation; scalars pass as they are; constexprs come from the source's
        META, set for the interpreter as tests/kernels/harness.py sets them."""
        import torch

        from infc.compiler.codegen.render import parse_meta
        from kernels.harness import interpreter_constexprs, load
        dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "f16": torch.float16, "fp32": torch.float32,
                  "f32": torch.float32, "i32": torch.int32, "i64": torch.int64, "i8": torch.int8,
                  "fp8e4nv": torch.float8_e4m3fn}
        source = self.fn.cubin.decode()
        meta = parse_meta(source, "triton")
        kid = "fake_" + hashlib.sha1(self.fn.cubin).hexdigest()[:16]
        kernel = getattr(load(types.SimpleNamespace(id=kid, source=source)), self.fn.name)
        args = []
        for (_, ty, _), v in zip(meta["params"], self.values):   # hidden trailing args: dropped
            if not ty.startswith("*"):
                args.append(v)
                continue
            dtype = dtypes.get(ty[1:], torch.uint8)
            if not v:
                args.append(torch.empty(0, dtype=dtype))
                continue
            rest, size = self.ctx.rest(v), dtype.itemsize
            args.append(torch.from_numpy(rest[: rest.size // size * size]).view(dtype))
        kernel[tuple(self.grid)](*args, **interpreter_constexprs(meta))


class FakeGraph:
    """driver.Graph: the launches record() issues, replayed by launch()."""

    def __init__(self, drv: "FakeDriver", ctx: FakeContext, record):
        assert ctx.capturing is None, "fake CUDA: nested capture"
        self.drv, self.ctx = drv, ctx
        ctx.capturing = []
        try:
            record()
        finally:
            self.calls, ctx.capturing = ctx.capturing, None

    def launch(self):
        for call in self.calls:
            self.drv._execute(dataclasses.replace(call, replay=True))


class FakeDriver:
    """Stands in for the module infc.runtime.cuda.driver. on_launch(launch) -> µs | None runs each
    launch (see the module docstring); context_kw are FakeContext's keywords for Context(). Its
    Context, Graph and DependentLaunch are classes (code annotates with them) bound to it."""
    Event, Module = FakeEvent, FakeModule

    def __init__(self, on_launch=None, **context_kw):
        real = importlib.import_module("infc.runtime.cuda.driver")   # inside cuda_modules()
        self.PackedArgs, self.CudaError = real.PackedArgs, real.CudaError
        self.on_launch, self.context_kw = on_launch, context_kw
        self.launches: list[Launch] = []
        self.contexts: list[FakeContext] = []
        drv = self

        class Context(FakeContext):
            def __init__(self, device: int = 0):
                super().__init__(device, **drv.context_kw)
                drv.contexts.append(self)

        class Graph(FakeGraph):
            def __init__(self, ctx: FakeContext, record):
                super().__init__(drv, ctx, record)

        class DependentLaunch:
            """driver.DependentLaunch: a launch recorded with dependent=True (all run in order)."""

            def __init__(self, ctx: FakeContext, block, shared: int):
                self.ctx, self.block, self.shared = ctx, block, shared

            def __call__(self, fn, grid, args):
                drv.launch(self.ctx, fn, grid, self.block, self.shared, args, dependent=True)

        self.Context, self.Graph, self.DependentLaunch = Context, Graph, DependentLaunch

    def launch(self, ctx: FakeContext, fn, grid, block, shared: int, args, stream=None, dependent: bool = False):
        storage = getattr(args, "storage", None)
        values = tuple(args) if storage is None else tuple(0 if c.value is None else c.value for c in storage)
        call = Launch(ctx, fn, tuple(int(g) for g in grid), tuple(block), shared, values, dependent=dependent)
        if ctx.capturing is not None:
            ctx.capturing.append(call)
        else:
            self._execute(call)

    def _execute(self, call: Launch):
        self.launches.append(call)
        if self.on_launch is not None:
            us = self.on_launch(call)
        elif isinstance(call.fn, FakeFunction) and call.fn.is_triton:
            us = call.run_triton()
        else:
            us = None
        call.ctx.clock += (us or 0.0) / 1e3


# -- installing it -------------------------------------------------------------------------------
PATCHED = ("Context", "Event", "Module", "Graph", "launch", "DependentLaunch")


@contextmanager
def cuda_modules():
    """infc.runtime.cuda.* importable inside: with a stand-in cuda.bindings where cuda-python is
    missing. Then the stand-in and the infc.runtime.cuda modules first imported inside (those that
    bind driver names) are dropped on the way out, and unhooked from their package, so later tests
    see neither; other modules imported inside (torch, triton, ...) stay."""
    try:
        import cuda.bindings.driver  # noqa: F401
        have = True
    except ImportError:
        have = False
    before = set(sys.modules)
    if not have:
        cuda, bindings, drv = (types.ModuleType(n) for n in ("cuda", "cuda.bindings", "cuda.bindings.driver"))
        cuda.bindings, bindings.driver = bindings, drv
        sys.modules.update({"cuda": cuda, "cuda.bindings": bindings, "cuda.bindings.driver": drv})
    try:
        yield
    finally:
        if not have:
            bound = [n for n in set(sys.modules) - before
                     if n == "cuda" or n.startswith(("cuda.", "infc.runtime.cuda."))]
            for name in sorted(bound, reverse=True):
                mod = sys.modules.pop(name)
                parent, _, child = name.rpartition(".")
                if parent in sys.modules and getattr(sys.modules[parent], child, None) is mod:
                    delattr(sys.modules[parent], child)


def _from_fake(obj) -> bool:
    """Whether obj is an earlier FakeDriver's name: a module first imported while one was installed
    (where cuda-python is present, cuda_modules keeps it) bound that driver's names, which no
    monkeypatch undoes; the next test's driver must replace them."""
    return (isinstance(getattr(obj, "__self__", None), FakeDriver) or obj in (FakeEvent, FakeModule)
            or getattr(obj, "__qualname__", "").startswith("FakeDriver.__init__."))


def install(monkeypatch, **kw) -> FakeDriver:
    """A FakeDriver(**kw) in place of infc.runtime.cuda.driver's PATCHED names, there and in every
    loaded infc module that imported them; then infc.runtime.cuda.runner (and what it imports) is
    loaded on the fake. Call inside cuda_modules()."""
    drv = FakeDriver(**kw)
    real = importlib.import_module("infc.runtime.cuda.driver")
    originals = {name: getattr(real, name) for name in PATCHED if hasattr(real, name)}
    for mod in [m for n, m in sys.modules.items() if n.startswith("infc.")]:
        for attr, orig in originals.items():
            cur = getattr(mod, attr, None)
            if mod is real or cur is orig or _from_fake(cur):
                monkeypatch.setattr(mod, attr, getattr(drv, attr))
    importlib.import_module("infc.runtime.cuda.runner")
    return drv
