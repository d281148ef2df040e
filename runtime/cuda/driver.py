"""A thin, checked layer over the CUDA driver API (cuda.bindings): context, stream, memory,
modules, launches with pre-packed argument arrays, events and CUDA Graphs.

Every call's result is checked; a failure raises CudaError naming the call. Launch arguments
are packed once into ctypes storage, so a launch costs one cuLaunchKernel and no Python
marshalling (and a graph replay costs none).
"""
import ctypes
import threading

import numpy as np

from infc import envs

try:
    from cuda.bindings import driver as cu
except ImportError as e:          # the CPU backend never gets here
    raise ImportError("the CUDA backend needs cuda-bindings (pip install 'infc[cuda]')") from e


class CudaError(RuntimeError):
    engine_fatal = True          # the context may be gone: the engine stops (engine.is_fatal)


def check(result, what: str = "CUDA call"):
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != cu.CUresult.CUDA_SUCCESS:
        _, name = cu.cuGetErrorName(err)
        raise CudaError(f"{what} failed: {name.decode() if isinstance(name, bytes) else name}")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else tuple(rest)


def _stream(priority=None):
    """A non-blocking stream, at `priority` where given (else the default, the least)."""
    flags = cu.CUstream_flags.CU_STREAM_NON_BLOCKING
    if priority is None:
        return check(cu.cuStreamCreate(flags), "cuStreamCreate")
    return check(cu.cuStreamCreateWithPriority(flags, priority), "cuStreamCreateWithPriority")


_CTYPE = {"i32": ctypes.c_int32, "u32": ctypes.c_uint32, "i64": ctypes.c_int64,
          "fp32": ctypes.c_float, "f32": ctypes.c_float, "fp16": ctypes.c_uint16}


_current = threading.local()
MEMHOSTALLOC_DEVICEMAP = 0x02        # cuda.h's CU_MEMHOSTALLOC_DEVICEMAP (a #define, not an enum)


class Context:
    def __init__(self, device: int = 0):
        try:
            check(cu.cuInit(0), "cuInit")
        except CudaError:
            raise
        except Exception as e:   # no driver: cuda.bindings raises instead of returning an error
            raise CudaError(f"no CUDA driver: {e}") from None
        self.device = check(cu.cuDeviceGet(device), "cuDeviceGet")
        self.ctx = check(cu.cuDevicePrimaryCtxRetain(self.device), "cuDevicePrimaryCtxRetain")
        check(cu.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")
        # INFC_STEP_STREAM_PRIORITY: the steps' stream first in the block scheduler's queue,
        # new_stream's at the least priority (the host KV tier's gathers on their own stream cost
        # 1024/128 throughput 5 %, bench/NOTES.md issue 44; the A/B is the next GPU call's)
        self._side_priority = greatest = None
        if envs.value("INFC_STEP_STREAM_PRIORITY"):
            self._side_priority, greatest = check(cu.cuCtxGetStreamPriorityRange(), "cuCtxGetStreamPriorityRange")
        self.stream = _stream(greatest)
        # What this context handed out, so close() gives it all back (a server keeps one for its
        # life; tests and tools make several runners in one process).
        self._device: set[int] = set()
        self._host: dict[int, np.ndarray] = {}
        self._graphs: list = []
        self._streams: list = []                 # new_stream's (the KV tiers' copy stream)
        self.name = check(cu.cuDeviceGetName(256, self.device), "cuDeviceGetName").split(b"\0")[0].decode()
        attr = cu.CUdevice_attribute
        self.sm_count = check(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, self.device))
        self.cc = (check(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self.device)),
                   check(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self.device)))

    def ensure_current(self):
        """Make the context current on the calling thread (the engine steps in its own thread;
        launches name their stream, but allocations such as pinned memory need a current one)."""
        if getattr(_current, "ctx", None) is not self.ctx:
            check(cu.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")
            _current.ctx = self.ctx

    def mem_info(self) -> tuple[int, int]:
        free, total = check(cu.cuMemGetInfo(), "cuMemGetInfo")
        return int(free), int(total)

    def alloc(self, nbytes: int) -> int:
        ptr = int(check(cu.cuMemAlloc(max(int(nbytes), 1)), f"cuMemAlloc({nbytes})"))
        self._device.add(ptr)
        return ptr

    def free(self, ptr: int):
        self._device.discard(ptr)
        check(cu.cuMemFree(ptr), "cuMemFree")

    def memset(self, ptr: int, nbytes: int, value: int = 0):
        check(cu.cuMemsetD8Async(ptr, value, nbytes, self.stream), "cuMemsetD8Async")

    def memset32(self, ptr: int, count: int, value: int):
        """count 32-bit words set to value (e.g. the bits of -inf)."""
        check(cu.cuMemsetD32Async(ptr, value, count, self.stream), "cuMemsetD32Async")

    def htod(self, ptr: int, host: np.ndarray):
        host = np.ascontiguousarray(host)
        check(cu.cuMemcpyHtoDAsync(ptr, host.ctypes.data, host.nbytes, self.stream), "cuMemcpyHtoDAsync")
        return host                # keep alive until the stream syncs

    def htod_rows(self, ptr: int, pitch: int, host: np.ndarray):
        """host [rows, w] into the first w columns of a device matrix whose rows are `pitch` bytes
        apart: only the columns a step uses cross the bus, the rest keep what they held."""
        host = np.ascontiguousarray(host)
        rows, row_bytes = host.shape[0], host.nbytes // max(host.shape[0], 1)
        if host.nbytes == 0:
            return host
        assert row_bytes <= pitch, (row_bytes, pitch)
        c = cu.CUDA_MEMCPY2D()
        c.srcMemoryType = cu.CUmemorytype.CU_MEMORYTYPE_HOST
        c.srcHost = host.ctypes.data
        c.srcPitch = row_bytes
        c.dstMemoryType = cu.CUmemorytype.CU_MEMORYTYPE_DEVICE
        c.dstDevice = ptr
        c.dstPitch = pitch
        c.WidthInBytes = row_bytes
        c.Height = rows
        check(cu.cuMemcpy2DAsync(c, self.stream), "cuMemcpy2DAsync")
        return host                # keep alive until the stream syncs

    def htod_raw(self, ptr: int, host_addr: int, nbytes: int, stream=None):
        """An async copy from host memory the caller keeps alive (pinned: truly async), on
        `stream` (default: the context's)."""
        check(cu.cuMemcpyHtoDAsync(ptr, host_addr, nbytes, self.stream if stream is None else stream),
              "cuMemcpyHtoDAsync")

    def dtoh_raw(self, host_addr: int, ptr: int, nbytes: int, stream=None):
        """An async copy into host memory the caller keeps alive (pinned: truly async, by the copy
        engine), on `stream` (default: the context's)."""
        check(cu.cuMemcpyDtoHAsync(host_addr, ptr, nbytes, self.stream if stream is None else stream),
              "cuMemcpyDtoHAsync")

    def dtoh(self, host: np.ndarray, ptr: int) -> np.ndarray:
        self.dtoh_raw(host.ctypes.data, ptr, host.nbytes)
        return host

    def dtod(self, dst: int, src: int, nbytes: int):
        check(cu.cuMemcpyDtoDAsync(dst, src, nbytes, self.stream), "cuMemcpyDtoDAsync")

    def copy2d(self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int,
               to_host: bool, stream=None):
        """`height` rows of `width` bytes between device and pinned host memory (to_host: device
        src -> host dst, else host src -> device dst), rows `*_pitch` bytes apart, async on
        `stream` (default: the context's)."""
        c = cu.CUDA_MEMCPY2D()
        host, device = cu.CUmemorytype.CU_MEMORYTYPE_HOST, cu.CUmemorytype.CU_MEMORYTYPE_DEVICE
        if to_host:
            c.srcMemoryType, c.srcDevice, c.dstMemoryType, c.dstHost = device, src, host, dst
        else:
            c.srcMemoryType, c.srcHost, c.dstMemoryType, c.dstDevice = host, src, device, dst
        c.srcPitch, c.dstPitch, c.WidthInBytes, c.Height = src_pitch, dst_pitch, width, height
        check(cu.cuMemcpy2DAsync(c, self.stream if stream is None else stream), "cuMemcpy2DAsync")

    def new_stream(self):
        """Another non-blocking stream (destroyed by close): work on it overlaps the context's."""
        s = _stream(self._side_priority)
        self._streams.append(s)
        return s

    def wait_event(self, event: "Event", stream=None):
        """Work issued on `stream` (default: the context's) from now on waits for the event's last
        record, on the device (the host does not wait)."""
        check(cu.cuStreamWaitEvent(self.stream if stream is None else stream, event.ev, 0), "cuStreamWaitEvent")

    def sync(self, stream=None):
        """The host waits for the context's stream's work (or another stream's: new_stream's)."""
        check(cu.cuStreamSynchronize(self.stream if stream is None else stream), "cuStreamSynchronize")

    def pinned(self, nbytes: int, mapped: bool = False) -> np.ndarray:
        """Page-locked host memory; mapped: into the device's address space too, so a kernel can
        read and write it (at device_ptr(host))."""
        flags = MEMHOSTALLOC_DEVICEMAP if mapped else 0
        ptr = check(cu.cuMemHostAlloc(nbytes, flags), "cuMemHostAlloc")
        host = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(int(ptr)))
        self._host[int(ptr)] = host
        return host

    def device_ptr(self, host: np.ndarray) -> int:
        """The device's address of mapped page-locked memory (pinned(mapped=True))."""
        return int(check(cu.cuMemHostGetDevicePointer(host.ctypes.data, 0), "cuMemHostGetDevicePointer"))

    def free_pinned(self, host: np.ndarray):
        """Give page-locked memory back (it counts in the process's resident memory)."""
        self._host.pop(host.ctypes.data, None)
        check(cu.cuMemFreeHost(host.ctypes.data), "cuMemFreeHost")

    def close(self):
        """Free every device and pinned allocation and graph made through this context, and its
        stream. Nothing made through it may be used afterwards."""
        self.ensure_current()
        self.sync()
        for s in self._streams:                  # their copies may still use what is freed below
            check(cu.cuStreamSynchronize(s), "cuStreamSynchronize")
        for g in self._graphs:
            check(cu.cuGraphExecDestroy(g.exec), "cuGraphExecDestroy")
            check(cu.cuGraphDestroy(g.graph), "cuGraphDestroy")
        for ptr in list(self._device):
            check(cu.cuMemFree(ptr), "cuMemFree")
        for addr in list(self._host):
            check(cu.cuMemFreeHost(addr), "cuMemFreeHost")
        self._graphs, self._device, self._host = [], set(), {}
        for s in self._streams:
            check(cu.cuStreamDestroy(s), "cuStreamDestroy")
        self._streams = []
        check(cu.cuStreamDestroy(self.stream), "cuStreamDestroy")
        self.stream = None

    def event(self) -> "Event":
        return Event(self)


class Event:
    def __init__(self, ctx: Context):
        self.ctx = ctx
        self.ev = check(cu.cuEventCreate(0), "cuEventCreate")

    def record(self, stream=None):
        """On `stream` (default: the context's)."""
        check(cu.cuEventRecord(self.ev, self.ctx.stream if stream is None else stream), "cuEventRecord")

    def wait(self):
        check(cu.cuEventSynchronize(self.ev), "cuEventSynchronize")

    def ms_since(self, start: "Event") -> float:
        check(cu.cuEventSynchronize(self.ev), "cuEventSynchronize")
        return float(check(cu.cuEventElapsedTime(start.ev, self.ev), "cuEventElapsedTime"))


class Module:
    def __init__(self, cubin: bytes):
        self.mod = check(cu.cuModuleLoadData(cubin), "cuModuleLoadData")

    def function(self, name: str, shared: int = 0):
        fn = check(cu.cuModuleGetFunction(self.mod, name.encode()), f"cuModuleGetFunction({name})")
        if shared > 48 * 1024:
            check(cu.cuFuncSetAttribute(
                fn, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, shared),
                f"cuFuncSetAttribute({name}, shared={shared})")
        return fn


class PackedArgs:
    """Kernel arguments stored once in ctypes memory; `address` is the void** to launch with."""

    def __init__(self, values: list, types: list[str]):
        self.storage = []
        for v, t in zip(values, types):
            c = ctypes.c_void_p(int(v)) if t.startswith("*") or t == "ptr" else _CTYPE[t](v)
            self.storage.append(c)
        self.array = (ctypes.c_void_p * max(len(self.storage), 1))(
            *[ctypes.cast(ctypes.pointer(c), ctypes.c_void_p) for c in self.storage])
        self.address = ctypes.addressof(self.array)

    def set(self, index: int, value):
        self.storage[index].value = value


def launch(ctx: Context, fn, grid, block, shared: int, args: PackedArgs, stream=None):
    """On `stream` (default: the context's)."""
    check(cu.cuLaunchKernel(fn, grid[0], grid[1], grid[2], block[0], block[1], block[2], shared,
                            ctx.stream if stream is None else stream, args.address, 0), "cuLaunchKernel")


class DependentLaunch:
    """One bound launch made a programmatic dependent of the kernel before it on the stream
    (Hopper's PDL, kept by stream capture as a programmatic graph edge): it may start while that
    kernel drains, and its kernel must wait (griddepcontrol.wait, codegen_templates/triton/_pdl.j2)
    before it reads what earlier kernels wrote. The config is built once; a launch rewrites only
    the grid."""

    def __init__(self, ctx: Context, block, shared: int):
        self.config = c = cu.CUlaunchConfig()
        c.blockDimX, c.blockDimY, c.blockDimZ = block
        c.sharedMemBytes = shared
        c.hStream = ctx.stream
        attr = cu.CUlaunchAttribute()
        attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        c.attrs = [attr]
        c.numAttrs = 1

    def __call__(self, fn, grid, args: PackedArgs):
        c = self.config
        c.gridDimX, c.gridDimY, c.gridDimZ = grid
        check(cu.cuLaunchKernelEx(c, fn, args.address, 0), "cuLaunchKernelEx")


class Graph:
    """Capture the launches `record()` issues on the context's stream; replay with `launch()`."""

    def __init__(self, ctx: Context, record):
        self.ctx = ctx
        check(cu.cuStreamBeginCapture(ctx.stream, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
              "cuStreamBeginCapture")
        try:
            record()
        finally:
            self.graph = check(cu.cuStreamEndCapture(ctx.stream), "cuStreamEndCapture")
        self.exec = check(cu.cuGraphInstantiate(self.graph, 0), "cuGraphInstantiate")
        ctx._graphs.append(self)

    def launch(self):
        check(cu.cuGraphLaunch(self.exec, self.ctx.stream), "cuGraphLaunch")
