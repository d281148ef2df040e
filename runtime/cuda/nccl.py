"""NCCL without torch: ctypes bindings over libnccl.so.2.

Why our own ctypes layer and not nccl4py: nccl4py (0.6.0) is a Cython build, one wheel per Python
version, and pulls cuda-core, cuda-pathfinder and, through its cu12/cu13 extras, the CUTLASS DSL;
the GPU machine has no registry, so every one of them would be carried for its Python. The runtime
needs a dozen C calls (version, unique id, init, all-reduce, all-gather, reduce-scatter,
broadcast, send/recv, group start/end, destroy, error strings) on raw device pointers and a raw
CUstream, which ctypes binds in a page, on any Python, over the library of the `nvidia-nccl-cu13`
wheel (pyproject's `cuda` extra) or the one torch already installed (the same wheel, for torch's
CUDA). Nothing here imports cuda-python: a stream is passed as its integer handle, so the same
module loads on a machine without a GPU (ncclGetVersion works there).

The library, first found of:
  $INFC_NCCL_LIB                 a path to libnccl.so.2 (or the directory holding it)
  <sys.path entry>/nvidia/nccl/lib/libnccl.so.2   the nvidia-nccl-cu13 / -cu12 wheel (torch's too)
  <sys.path entry>/torch/lib/libnccl.so.2         builds of torch that bundle it
  libnccl.so.2                   the system loader (LD_LIBRARY_PATH, ldconfig)

Every call's ncclResult_t is checked: a failure raises NcclError with NCCL's own message
(ncclGetErrorString, and ncclGetLastError's detail when the library has one).
"""
import ctypes
import sys
from contextlib import contextmanager
from pathlib import Path

from infc import envs

UNIQUE_ID_BYTES = 128
# ncclDataType_t (nccl.h): the dtypes a plan's buffers use
DTYPES = {"i8": 0, "u8": 1, "i32": 2, "u32": 3, "i64": 4, "u64": 5, "f16": 6, "f32": 7, "f64": 8,
          "bf16": 9}
OPS = {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}          # ncclRedOp_t
LIB_NAME = "libnccl.so.2"


class NcclError(RuntimeError):
    engine_fatal = True          # a communicator in error: the engine stops (engine.is_fatal)


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * UNIQUE_ID_BYTES)]


def candidates() -> list[str]:
    """Where the library is looked for, in order (paths that exist, then the bare name)."""
    out = []
    env = envs.value("INFC_NCCL_LIB")
    if env:
        p = Path(env)
        return [str(p / LIB_NAME if p.is_dir() else p)]       # an explicit choice: only it
    for entry in sys.path:
        for sub in ("nvidia/nccl/lib", "torch/lib"):
            p = Path(entry or ".") / sub / LIB_NAME
            if p.is_file() and str(p) not in out:
                out.append(str(p))
    out.append(LIB_NAME)
    return out


_lib = None


def library() -> "Nccl":
    """The loaded library (once per process); NcclError naming every place tried if none loads."""
    global _lib
    if _lib is None:
        tried = []
        for path in candidates():
            try:
                _lib = Nccl(ctypes.CDLL(path), path)
                break
            except OSError as e:
                tried.append(f"{path}: {e}")
        else:
            raise NcclError("cannot load NCCL (" + "; ".join(tried) + "): install the "
                            "nvidia-nccl-cu13 wheel (pip install 'infc[cuda]') or set "
                            "INFC_NCCL_LIB to libnccl.so.2")
    return _lib


def _handle(x) -> int:
    """A device pointer or CUstream as the integer C expects (cuda-bindings objects give int())."""
    return 0 if x is None else int(x)


class Nccl:
    """The C functions, typed; `check` turns a result code into NcclError."""

    def __init__(self, lib, path: str):
        self.lib, self.path = lib, path
        vp, i, sz, res = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_int
        sigs = {
            "ncclGetVersion": [ctypes.POINTER(i)],
            "ncclGetUniqueId": [ctypes.POINTER(UniqueId)],
            "ncclCommInitRank": [ctypes.POINTER(vp), i, UniqueId, i],
            "ncclCommDestroy": [vp],
            "ncclCommAbort": [vp],
            "ncclCommCount": [vp, ctypes.POINTER(i)],
            "ncclCommUserRank": [vp, ctypes.POINTER(i)],
            "ncclAllReduce": [vp, vp, sz, i, i, vp, vp],
            "ncclAllGather": [vp, vp, sz, i, vp, vp],
            "ncclReduceScatter": [vp, vp, sz, i, i, vp, vp],
            "ncclBroadcast": [vp, vp, sz, i, i, vp, vp],
            "ncclSend": [vp, sz, i, i, vp, vp],
            "ncclRecv": [vp, sz, i, i, vp, vp],
            "ncclGroupStart": [],
            "ncclGroupEnd": [],
        }
        for name, args in sigs.items():
            fn = getattr(lib, name)            # AttributeError: not an NCCL library
            fn.argtypes, fn.restype = args, res
        lib.ncclGetErrorString.argtypes, lib.ncclGetErrorString.restype = [res], ctypes.c_char_p
        self.last_error = getattr(lib, "ncclGetLastError", None)      # NCCL >= 2.13
        if self.last_error is not None:
            self.last_error.argtypes, self.last_error.restype = [vp], ctypes.c_char_p

    def error_string(self, code: int) -> str:
        s = self.lib.ncclGetErrorString(int(code))
        return s.decode() if s else f"NCCL error {code}"

    def check(self, code: int, what: str, comm=None):
        if code == 0:
            return
        msg = f"{what} failed: {self.error_string(code)} (ncclResult_t {code})"
        if self.last_error is not None:
            detail = self.last_error(comm)
            if detail:
                msg += f": {detail.decode(errors='replace')}"
        raise NcclError(msg)

    def version(self) -> tuple[int, int, int]:
        v = ctypes.c_int()
        self.check(self.lib.ncclGetVersion(ctypes.byref(v)), "ncclGetVersion")
        code = v.value                       # 2.x: major*10000 + minor*100 + patch
        return (code // 10000, code // 100 % 100, code % 100) if code >= 10000 else \
            (code // 1000, code // 100 % 10, code % 100)

    def unique_id(self) -> bytes:
        """A new communicator id: rank 0 makes it and hands it to the other ranks."""
        uid = UniqueId()
        self.check(self.lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
        return ctypes.string_at(ctypes.addressof(uid), UNIQUE_ID_BYTES)

    def group_start(self):
        self.check(self.lib.ncclGroupStart(), "ncclGroupStart")

    def group_end(self):
        self.check(self.lib.ncclGroupEnd(), "ncclGroupEnd")


def version() -> tuple[int, int, int]:
    return library().version()


def unique_id() -> bytes:
    return library().unique_id()


def _dtype(dtype: str) -> int:
    if dtype not in DTYPES:
        raise NcclError(f"NCCL has no data type for '{dtype}' (known: {', '.join(DTYPES)})")
    return DTYPES[dtype]


class Communicator:
    """One rank's communicator (one per process and GPU). Buffers are device pointers (int),
    counts are elements, `stream` the CUstream to enqueue on (the runner's: a CUDA Graph captured
    on it records the collective)."""

    def __init__(self, world: int, rank: int, uid: bytes, lib: Nccl | None = None):
        if not 0 <= rank < world:
            raise NcclError(f"rank {rank} is not in a world of {world}")
        if len(uid) != UNIQUE_ID_BYTES:
            raise NcclError(f"an NCCL unique id is {UNIQUE_ID_BYTES} bytes, got {len(uid)}")
        self.nccl = lib or library()
        self.world, self.rank = world, rank
        comm = ctypes.c_void_p()
        u = UniqueId()
        ctypes.memmove(ctypes.addressof(u), uid, UNIQUE_ID_BYTES)
        self.nccl.check(self.nccl.lib.ncclCommInitRank(ctypes.byref(comm), world, u, rank),
                        f"ncclCommInitRank(world {world}, rank {rank})")
        self.comm = comm

    def _call(self, name: str, *args):
        if self.comm is None:
            raise NcclError(f"{name} on a destroyed communicator")
        self.nccl.check(getattr(self.nccl.lib, name)(*args), name, self.comm)

    def count(self) -> int:
        n = ctypes.c_int()
        self._call("ncclCommCount", self.comm, ctypes.byref(n))
        return n.value

    def user_rank(self) -> int:
        n = ctypes.c_int()
        self._call("ncclCommUserRank", self.comm, ctypes.byref(n))
        return n.value

    def all_reduce(self, send: int, recv: int, count: int, dtype: str, stream, op: str = "sum"):
        self._call("ncclAllReduce", _handle(send), _handle(recv), count, _dtype(dtype), OPS[op],
                   self.comm, _handle(stream))

    def all_gather(self, send: int, recv: int, count: int, dtype: str, stream):
        """recv[rank * count: (rank + 1) * count] = each rank's send[:count], in rank order."""
        self._call("ncclAllGather", _handle(send), _handle(recv), count, _dtype(dtype), self.comm,
                   _handle(stream))

    def reduce_scatter(self, send: int, recv: int, count: int, dtype: str, stream, op: str = "sum"):
        """recv[:count] = the reduction of every rank's send[rank * count: (rank + 1) * count]."""
        self._call("ncclReduceScatter", _handle(send), _handle(recv), count, _dtype(dtype), OPS[op],
                   self.comm, _handle(stream))

    def broadcast(self, send: int, recv: int, count: int, dtype: str, root: int, stream):
        self._call("ncclBroadcast", _handle(send), _handle(recv), count, _dtype(dtype), root,
                   self.comm, _handle(stream))

    def send(self, buf: int, count: int, dtype: str, peer: int, stream):
        self._call("ncclSend", _handle(buf), count, _dtype(dtype), peer, self.comm, _handle(stream))

    def recv(self, buf: int, count: int, dtype: str, peer: int, stream):
        self._call("ncclRecv", _handle(buf), count, _dtype(dtype), peer, self.comm, _handle(stream))

    @contextmanager
    def group(self):
        """ncclGroupStart/End around point-to-point calls (a send/recv pair, an all-to-all)."""
        self.nccl.group_start()
        try:
            yield
        finally:
            self.nccl.group_end()

    def destroy(self):
        if self.comm is not None:
            comm, self.comm = self.comm, None
            self.nccl.check(self.nccl.lib.ncclCommDestroy(comm), "ncclCommDestroy")

    def abort(self):
        if self.comm is not None:
            comm, self.comm = self.comm, None
            self.nccl.check(self.nccl.lib.ncclCommAbort(comm), "ncclCommAbort")
