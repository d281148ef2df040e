"""The CUDA runtime's ranks without a GPU (runtime/cuda/nccl.py, collectives.py, ranks.py).

- NCCL: the loader's error names every place it tried; with the nvidia-nccl wheel installed, the
  real library loads here (no GPU needed): version, unique ids, NCCL's own error strings, and a
  communicator that cannot start without a GPU fails with NCCL's message.
- The collectives' helper kernels (rendered by the build, run under TRITON_INTERPRET on a fake
  device memory) and copies equal the numpy references of compiler/ops/collectives.py BIT FOR
  BIT: DeviceCopyGroup for 2 and 3 ranks, and NcclCollectives' own packing around a fake
  communicator (threads, one per rank) for ep_dispatch / all_gather.
- The lockstep driver (DeviceCopyRanks) runs every rank's CudaRunner, its real binding, upload
  and launch code, on the fake device with every kernel of the TP=2 and TP x EP=2 plans
  interpreted: every collective of every step equals its numpy reference on its inputs (bit
  for bit), every rank ends with the same logits bits, and the logits are the numpy simulated
  ranks' (runtime/reference/ranks.py) within bf16 tolerance, through prefill, eager decode and
  the decode "graph" (a fake Graph that replays what was captured).
"""
import ctypes
import importlib
import importlib.metadata
import inspect
import os
import sys
import threading
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import triton  # noqa: F401  (imported before cuda_mods records sys.modules: never dropped)
from exhaustive import EXHAUSTIVE, pairwise
from fake_cuda import cuda_modules
from kernels.harness import load

from infc.compiler.ops import REGISTRY
from infc.compiler.build import build_ranks
from infc.compiler.parallel import settings
from infc.runtime.reference.ranks import RankExchange

BASE = 1 << 32                               # fake device addresses start here
TORCH_PTR = {"*bf16": torch.bfloat16, "*fp32": torch.float32, "*i32": torch.int32,
             "*fp16": torch.float16, "*i8": torch.int8, "*u8": torch.uint8, "*i64": torch.int64,
             "*fp8e4nv": torch.float8_e4m3fn}
NP = {"bf16": None, "f32": np.float32, "i32": np.int32}


@pytest.fixture
def cuda_mods():
    """runtime.cuda.{collectives,ranks,runner,driver} importable with a stand-in cuda.bindings
    when this machine has none (fake_cuda.cuda_modules); those modules are dropped afterwards."""
    with cuda_modules():
        yield types.SimpleNamespace(**{m: importlib.import_module(f"infc.runtime.cuda.{m}")
                                       for m in ("driver", "collectives", "ranks", "runner", "artifact")})


# -- NCCL ---------------------------------------------------------------------------------------
def test_nccl_loader_names_what_it_tried(monkeypatch, tmp_path):
    from infc.runtime.cuda import nccl
    monkeypatch.setattr(nccl, "_lib", None)
    monkeypatch.setenv("INFC_NCCL_LIB", str(tmp_path))                # a directory: its libnccl.so.2
    assert nccl.candidates() == [str(tmp_path / "libnccl.so.2")]
    with pytest.raises(nccl.NcclError) as e:
        nccl.library()
    assert str(tmp_path / "libnccl.so.2") in str(e.value) and "INFC_NCCL_LIB" in str(e.value)
    bogus = tmp_path / "libnccl.so.2"
    bogus.write_text("not a library")
    monkeypatch.setenv("INFC_NCCL_LIB", str(bogus))
    with pytest.raises(nccl.NcclError, match="cannot load NCCL"):
        nccl.library()
    monkeypatch.delenv("INFC_NCCL_LIB")
    # without the variable: the wheels' nvidia/nccl/lib on sys.path first, the system loader last
    fake_site = tmp_path / "site"
    (fake_site / "nvidia" / "nccl" / "lib").mkdir(parents=True)
    (fake_site / "nvidia" / "nccl" / "lib" / "libnccl.so.2").write_bytes(b"")
    monkeypatch.setattr(sys, "path", [str(fake_site)] + sys.path)
    got = nccl.candidates()
    assert got[0] == str(fake_site / "nvidia" / "nccl" / "lib" / "libnccl.so.2") and got[-1] == "libnccl.so.2"


def _wheel_nccl():
    for dist in ("nvidia-nccl-cu13", "nvidia-nccl-cu12"):
        try:
            importlib.metadata.version(dist)
            return dist
        except importlib.metadata.PackageNotFoundError:
            pass
    return None


@pytest.mark.skipif(_wheel_nccl() is None, reason="no nvidia-nccl wheel installed")
def test_nccl_library_without_a_gpu(monkeypatch):
    from infc.runtime.cuda import nccl
    monkeypatch.setattr(nccl, "_lib", None)
    monkeypatch.delenv("INFC_NCCL_LIB", raising=False)
    lib = nccl.library()
    assert "nvidia/nccl/lib" in lib.path or "torch/lib" in lib.path
    major, minor, patch = nccl.version()
    want = importlib.metadata.version(_wheel_nccl()).split(".")
    assert (major, minor, patch) == tuple(int(x) for x in want[:3])
    a, b = nccl.unique_id(), nccl.unique_id()
    assert len(a) == nccl.UNIQUE_ID_BYTES and a != b
    assert "invalid usage" in lib.error_string(5) and "invalid argument" in lib.error_string(4)
    with pytest.raises(nccl.NcclError, match=r"ncclAllReduce failed: invalid argument.*\(ncclResult_t 4\)"):
        lib.check(4, "ncclAllReduce")
    lib.check(0, "fine")
    with pytest.raises(nccl.NcclError, match="rank 2 is not in a world of 2"):
        nccl.Communicator(2, 2, a)
    with pytest.raises(nccl.NcclError, match="128 bytes"):
        nccl.Communicator(1, 0, a[:16])
    with pytest.raises(nccl.NcclError, match="no data type for 'q4'"):
        nccl._dtype("q4")
    if not os.path.exists("/dev/nvidiactl"):               # no GPU: NCCL says why it cannot start
        with pytest.raises(nccl.NcclError, match=r"ncclCommInitRank\(world 1, rank 0\) failed: "):
            nccl.Communicator(1, 0, a)


# -- a fake device: one torch byte tensor, kernels under the Triton interpreter ---------------------
class FakeEvent:
    def record(self, stream=None):
        pass

    def wait(self):
        pass

    def ms_since(self, start):
        return 0.0


class FakeCtx:
    """The driver Context's methods over host memory; device pointers are BASE + offset."""

    def __init__(self, nbytes=48 << 20):
        self.mem = torch.zeros(nbytes, dtype=torch.uint8)
        self.top = 0
        self.stream = "fake-stream"
        self.copies = 0
        self.mapped = {}                 # pinned(mapped=True): host address -> device pointer

    def _at(self, ptr, n):
        off = int(ptr) - BASE
        assert 0 <= off and off + n <= self.top, (hex(ptr), n)
        return self.mem[off: off + n]

    def alloc(self, n):
        ptr = BASE + self.top
        self.top += -(-max(int(n), 1) // 256) * 256
        assert self.top <= self.mem.numel(), "fake device memory exhausted"
        self.mem[ptr - BASE: self.top] = 0xAB                # poison
        return ptr

    def free(self, ptr):
        pass

    def memset(self, ptr, n, value=0):
        self._at(ptr, n).fill_(value)

    def memset32(self, ptr, count, value):
        self._at(ptr, 4 * count).view(torch.int32).fill_(np.int32(np.uint32(value).view(np.int32)))

    def htod(self, ptr, host):
        host = np.ascontiguousarray(host)
        self._at(ptr, host.nbytes).copy_(torch.from_numpy(host.reshape(-1).view(np.uint8).copy()))
        return host

    def htod_rows(self, ptr, pitch, host):
        host = np.ascontiguousarray(host)
        for i, row in enumerate(host):
            self.htod(ptr + i * pitch, row)
        return host

    def htod_raw(self, ptr, host_addr, n, stream=None):
        self._at(ptr, n).copy_(torch.frombuffer(bytearray(ctypes.string_at(host_addr, n)), dtype=torch.uint8))

    def dtoh(self, host, ptr):
        host.reshape(-1).view(np.uint8)[:] = self._at(ptr, host.nbytes).numpy()
        return host

    def dtod(self, dst, src, n):
        self._at(dst, n).copy_(self._at(src, n).clone())
        self.copies += 1

    def pinned(self, n, mapped=False):
        """mapped: device memory the host sees too (a numpy view of it), as under UVA."""
        if not mapped:
            return np.zeros(n, np.uint8)
        ptr = self.alloc(n)
        host = self._at(ptr, n).numpy()
        self.mapped[host.ctypes.data] = ptr
        return host

    def device_ptr(self, host):
        return self.mapped[host.ctypes.data]

    def free_pinned(self, host):
        pass

    def event(self):
        return FakeEvent()

    def sync(self, stream=None):
        pass

    def new_stream(self):
        return object()

    def wait_event(self, event, stream=None):
        pass

    def ensure_current(self):
        pass

    def mem_info(self):
        return self.mem.numel() - self.top, self.mem.numel()

    def close(self):
        self.stream = None

    # test helpers
    def put(self, ptr, a: np.ndarray, dtype: str):
        self.htod(ptr, _bits(a, dtype))

    def get(self, ptr, shape, dtype: str) -> np.ndarray:
        """f32 (bf16/f32 buffers) or i32 values."""
        n = int(np.prod(shape))
        t = self._at(ptr, n * (2 if dtype == "bf16" else 4))
        if dtype == "bf16":
            return t.view(torch.bfloat16).float().numpy().reshape(shape)
        return t.view(torch.float32 if dtype == "f32" else torch.int32).numpy().reshape(shape).copy()


def _bits(a, dtype):
    if dtype == "bf16":
        return torch.from_numpy(np.asarray(a, np.float32)).to(torch.bfloat16).view(torch.int16).numpy()
    return np.asarray(a, NP[dtype])


def _memcpy2d(ctx, dst, dpitch, src, spitch, width, height):
    for i in range(height):
        ctx.dtod(dst + i * dpitch, src + i * spitch, width)


class FakeFn:
    """A kernel 'function': runs the rendered source under the interpreter on the fake memory."""
    lock = threading.Lock()

    def __init__(self, kernel):
        self.kernel = kernel

    def __call__(self, ctx, grid, args):
        meta = self.kernel.meta
        vals = []
        for (name, ty, _), c in zip(meta["params"], args.storage):
            v = c.value
            if ty.startswith("*"):
                off = int(v) - BASE
                isz = torch.tensor([], dtype=TORCH_PTR[ty]).element_size()
                n = (ctx.mem.numel() - off) // isz * isz
                vals.append(ctx.mem[off: off + n].view(TORCH_PTR[ty]))
            else:
                vals.append(v)
        consts = dict(meta["constexprs"])
        consts.update({k: v for k, v in (("DOT_F32", True), ("PDL", False)) if k in consts})
        with self.lock:
            getattr(load(self.kernel), meta["entry"])[tuple(grid)](*vals, **consts)


def fake_launch(ctx, fn, grid, block, shared, args):
    fn(ctx, grid, args)


def kernel_fns(cuda_mods, artifact, plan):
    from infc.compiler.codegen.render import Kernel
    out = {}
    for kid, meta in plan["kernels"].items():
        src = (Path(artifact) / meta["source"]).read_text()
        k = Kernel(kid, meta["backend"], meta["template"], src, meta)
        out[kid] = cuda_mods.artifact.KernelFn(kid, meta, {"num_warps": meta.get("num_warps", 4)}, FakeFn(k))
    return out


@pytest.fixture
def fake_device(cuda_mods, monkeypatch):
    monkeypatch.setenv("INFC_PDL", "0")
    monkeypatch.setattr(cuda_mods.collectives, "launch", fake_launch)
    monkeypatch.setattr(cuda_mods.collectives, "_memcpy2d", _memcpy2d)
    monkeypatch.setattr(cuda_mods.runner, "launch", fake_launch)
    monkeypatch.setattr(cuda_mods.runner, "load_kernels",
                        lambda artifact, plan: kernel_fns(cuda_mods, artifact, plan))
    return cuda_mods


@pytest.fixture(scope="module")
def artifacts(tiny_model, tmp_path_factory):
    """Parallel artifacts of the conftest's tiny models, kernels rendered (no cubins)."""
    cache = {}

    def get(family, **par):
        key = (family, tuple(sorted(par.items())))
        if key not in cache:
            d, _ = tiny_model(family)
            out = tmp_path_factory.mktemp(f"ranks-{family}")
            build_ranks(settings(**par), model_dir=str(d), out=out, compile=False, log=None)
            cache[key] = (d, out)
        return cache[key]

    return get


def _ref(op, xs_per_rank, attrs, world):
    """Every rank's numpy reference output(s) for the ranks' inputs (compiler/ops/collectives.py)."""
    ex = RankExchange(world)
    ex.current = xs_per_rank
    outs = []
    for r in range(world):
        ctx = types.SimpleNamespace(rank=r, world=world, exchange=ex)
        fn = REGISTRY[op].reference
        takes = inspect.signature(fn).parameters            # all_gather's `world` is for its shape rule
        res = fn(ctx, *xs_per_rank[r], **{k: v for k, v in attrs.items() if k in takes})
        outs.append(res if isinstance(res, tuple) else (res,))
    return outs


def _assert_bits(got, want, dtype, what):
    want = np.asarray(want)
    if dtype == "bf16":      # the reference's f32 result, rounded once to the buffer's bf16
        want = torch.from_numpy(np.asarray(want, np.float32)).to(torch.bfloat16).float().numpy()
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert np.array_equal(got.astype(np.float64), np.asarray(want, np.float64)), \
        f"{what}: max diff {np.abs(got.astype(np.float64) - want).max()}"


# -- helper kernels and copies against the references ----------------------------------------------
H, K = 40, 3                     # a row of 40 (not a power of 2), top-3 routing


def synthetic_plan(world: int) -> dict:
    """A rank plan with one launch of each collective (the shapes a model's would have), for
    compiler/codegen/rank_kernels.py to render the helpers of."""
    buffers = {"x": (["T", H], "bf16"), "w": (["T", K], "f32"), "ids": (["T", K], "i32"),
               "sum": (["T", H], "bf16"), "comb": (["T", H], "bf16"), "xr": (["T", H], "bf16"),
               "wr": (["T", K], "f32"), "idr": (["T", K], "i32"), "g0": (["T", H], "bf16"),
               "g1": (["T", H * world], "bf16"), "xf": (["T", H], "f32"), "sumf": (["T", H], "bf16"),
               "xl": (["T", H], "bf16"), "xrl": (["T", H], "bf16"), "wrl": (["T", K], "f32"),
               "idrl": (["T", K], "i32"),
               # data-parallel ranks: every rank's rows (G = world * T) and each rank's back
               "xg": (["G", H], "bf16"), "wg": (["G", K], "f32"), "idg": (["G", K], "i32"),
               "yg": (["G", H], "bf16"), "yc": (["T", H], "bf16")}
    launches = [("all_reduce", ["x"], ["sum"], {}), ("ep_combine", ["x"], ["comb"], {}),
                ("ep_dispatch", ["x", "w", "ids"], ["xr", "wr", "idr"], {"experts_per_rank": 2}),
                ("all_gather", ["x"], ["g0"], {"axis": 0, "world": world}),
                ("all_gather", ["x"], ["g1"], {"axis": 1, "world": world}),
                # a row-parallel linear's fp32 partials, summed and rounded once to bf16
                ("all_reduce", ["xf"], ["sumf"], {"dtype": "bf16"}),
                # every rank holds the same rows (the parallel modes built so far): no traffic
                ("ep_dispatch", ["xl", "w", "ids"], ["xrl", "wrl", "idrl"],
                 {"experts_per_rank": 2, "replicated": True}),
                ("dp_dispatch", ["x", "w", "ids"], ["xg", "wg", "idg"], {"experts_per_rank": 2}),
                ("dp_combine", ["yg"], ["yc"], {})]
    return {"parallel": {"world": world, "rank": 0, "tp": world, "ep": world},
            "buffers": {n: {"shape": s, "dtype": d} for n, (s, d) in buffers.items()},
            "programs": {"prefill": [{"op": op, "backend": "nccl", "kernel": None, "inputs": i,
                                      "outputs": o, "attrs": a} for op, i, o, a in launches]}}


def step_dims(T, world):
    return {"T": T, "B": T, "G": world * T}


def _rows(d, T, world):
    return T if d == "T" else world * T if d == "G" else d


def collective_launches(cuda_mods, ctx, world, T):
    """[launch][rank] -> CollectiveLaunch over fresh fake buffers (all_gather's axis-0 output is
    world * T rows), with the helpers rendered for this world."""
    from infc.compiler.codegen.rank_kernels import render_rank_kernels
    C = cuda_mods.collectives
    plan = synthetic_plan(world)
    kernels = render_rank_kernels(plan)
    fns = {kid: cuda_mods.artifact.KernelFn(kid, k.meta, {"num_warps": 4}, FakeFn(k)) for kid, k in kernels.items()}
    out = []
    for launch in plan["programs"]["prefill"]:
        per_rank = []
        for r in range(world):
            def buf(name, rows=None):
                b = plan["buffers"][name]
                rows = rows or _rows(b["shape"][0], T, world)
                n = rows * int(np.prod(b["shape"][1:])) * (2 if b["dtype"] == "bf16" else 4)
                return C.Buffer(name, ctx.alloc(n), list(b["shape"]), b["dtype"])
            outs = [buf(n, world * T if n == "g0" else None) for n in launch["outputs"]]
            per_rank.append(C.CollectiveLaunch(launch["op"], launch["attrs"], [buf(n) for n in launch["inputs"]],
                                               outs, {m: fns[k] for m, k in launch.get("helpers", {}).items()},
                                               0, step_dims(T, world), launch["op"]))
        out.append(per_rank)
    return out


def fill_inputs(ctx, rng, cls, T, world):
    """Random inputs, different on every rank (so the owner's row is the one that must arrive),
    but the same rows on every rank for a replicated dispatch's x; ids over all world * 2 experts.
    Returns what the device holds, per rank."""
    vals, shared = [], {}
    for c in cls:
        mine = []
        for i, b in enumerate(c.inputs):
            shape = [_rows(d, T, world) for d in b.shape]
            a = rng.integers(0, 2 * world, shape).astype(np.int32) if b.dtype == "i32" else \
                rng.standard_normal(shape).astype(np.float32)
            if c.attrs.get("replicated") and i == 0:
                a = shared.setdefault(b.name, a)
            ctx.put(b.ptr, a, b.dtype)
            mine.append(ctx.get(b.ptr, shape, b.dtype))
        vals.append(mine)
    return vals


def check_outputs(ctx, cls, ins, T):
    world = len(cls)
    want = _ref(cls[0].op, ins, cls[0].attrs, world)
    for r, c in enumerate(cls):
        for i, o in enumerate(c.outputs):
            rows = world * T if (c.op == "all_gather" and c.attrs["axis"] == 0) else T
            shape = [rows if d == "T" else _rows(d, T, world) for d in o.shape]
            _assert_bits(ctx.get(o.ptr, shape, o.dtype), want[r][i], o.dtype, f"{c.op} {c.attrs} rank {r} out {i}")


@pytest.mark.parametrize("world", [2, 3])
def test_device_copy_collectives_are_the_references(fake_device, world, rng):
    C = fake_device.collectives
    ctx, T = FakeCtx(4 << 20), 7                 # 7 tokens: the owners (t % world) hold unequal shares
    group = C.DeviceCopyGroup(ctx, world)
    seen = []
    group.observe = lambda op, cls, dims: seen.append(op)
    for cls in collective_launches(fake_device, ctx, world, T):
        ins = fill_inputs(ctx, rng, cls, T, world)
        fires = [group.member(r).bind(c) for r, c in enumerate(cls)]
        n = len(seen)
        for f in fires[:-1]:
            f(step_dims(T, world))
        assert len(seen) == n and len(group.waiting) == world - 1    # issued by the last rank only
        fires[-1](step_dims(T, world))
        assert len(seen) == n + 1 and not group.waiting
        check_outputs(ctx, cls, ins, T)
    assert seen == ["all_reduce", "ep_combine", "ep_dispatch", "all_gather", "all_gather", "all_reduce",
                    "ep_dispatch", "dp_dispatch", "dp_combine"]


def test_a_replicated_dispatch_checks_that_the_ranks_rows_agree(rng):
    """The reference of a dispatch that moves nothing refuses ranks whose rows differ: the local
    selection would then compute each rank's experts on other inputs."""
    T = 5
    x = rng.standard_normal((T, H)).astype(np.float32)
    w = rng.random((T, K)).astype(np.float32)
    ids = rng.integers(0, 4, (T, K)).astype(np.int32)
    attrs = {"experts_per_rank": 2, "replicated": True}
    same = _ref("ep_dispatch", [(x, w, ids), (x.copy(), w, ids)], attrs, 2)
    moved = _ref("ep_dispatch", [(x, w, ids), (x.copy(), w, ids)], {"experts_per_rank": 2}, 2)
    for a, b in zip(same, moved):
        assert all(np.array_equal(p, q) for p, q in zip(a, b))
    other = x.copy()
    other[3, 7] += 1.0
    with pytest.raises(AssertionError, match="rank 1's token rows differ"):
        _ref("ep_dispatch", [(x, w, ids), (other, w, ids)], attrs, 2)


def test_device_copy_group_refuses_ranks_out_of_step(fake_device):
    C = fake_device.collectives
    ctx = FakeCtx(1 << 20)
    group = C.DeviceCopyGroup(ctx, 2)
    ar, _, disp = collective_launches(fake_device, ctx, 2, 4)[:3]
    f1 = group.member(1).bind(ar[1])
    with pytest.raises(RuntimeError, match="out of lockstep: rank 1"):
        f1({"T": 4, "B": 4})
    group.member(0).bind(ar[0])({"T": 4, "B": 4})
    with pytest.raises(RuntimeError, match="ranks diverge"):
        group.member(1).bind(disp[1])({"T": 4, "B": 4})
    no_helper = C.CollectiveLaunch("all_reduce", {}, ar[0].inputs, ar[0].outputs, {}, 0, {}, "all_reduce (layer 0)")
    with pytest.raises(RuntimeError, match="no 'device_copy' helper kernel.*rebuild"):
        group.member(0).bind(no_helper)


def in_rank_threads(comms, fns: list):
    """Run fns[r] (rank r's part) in a thread each; the first error aborts the others' barrier
    (no rank waits for a dead one) and is raised here."""
    errors = []

    def run(fn):
        try:
            fn()
        except BaseException as e:           # noqa: BLE001 - re-raised below
            errors.append(e)
            comms.barrier.abort()
    threads = [threading.Thread(target=run, args=(fn,)) for fn in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


class FakeComms:
    """NCCL's semantics for N ranks in threads over the fake memory (sum in rank order)."""

    def __init__(self, ctx, world):
        self.ctx, self.world = ctx, world
        self.barrier = threading.Barrier(world, timeout=60)
        self.slots = [None] * world
        self.calls = []

    def comm(self, rank):
        return types.SimpleNamespace(world=self.world, rank=rank,
                                     all_gather=lambda *a: self.all_gather(rank, *a),
                                     all_reduce=lambda *a: self.all_reduce(rank, *a),
                                     reduce_scatter=lambda *a: self.reduce_scatter(rank, *a))

    def all_gather(self, rank, send, recv, count, dtype, stream):
        nb = count * (2 if dtype == "bf16" else 4)
        self.calls.append(("all_gather", rank, count))
        self.slots[rank] = self.ctx._at(send, nb).clone()
        self.barrier.wait()
        for q in range(self.world):
            self.ctx._at(recv + q * nb, nb).copy_(self.slots[q])
        self.barrier.wait()

    def reduce_scatter(self, rank, send, recv, count, dtype, stream):
        """recv[:count] = the rank-ordered sum of every rank's block `rank` of send."""
        self.calls.append(("reduce_scatter", rank, count))
        self.slots[rank] = self.ctx.get(send, [self.world * count], dtype)
        self.barrier.wait()
        acc = np.array(self.slots[0][rank * count:(rank + 1) * count], np.float32)
        for q in range(1, self.world):
            acc += self.slots[q][rank * count:(rank + 1) * count]
        self.barrier.wait()
        self.ctx.put(recv, acc, dtype)

    def all_reduce(self, rank, send, recv, count, dtype, stream):
        self.calls.append(("all_reduce", rank, count))
        self.slots[rank] = self.ctx.get(send, [count], dtype)
        self.barrier.wait()
        acc = np.array(self.slots[0], np.float32)
        for q in range(1, self.world):
            acc += self.slots[q]
        self.barrier.wait()
        self.ctx.put(recv, acc, dtype)


# every world size with each collective form and each dispatch, pairwise (all 16 with --exhaustive):
# the split and the gather add their own collectives independently (the count asserted below)
@pytest.mark.parametrize("world,T,split,gather", pairwise(
    [(2, 7), (3, 7), (3, 2), (1, 5)], [False, True], [False, True],
    ids=[None, ["all-reduce", "reduce-scatter"], ["local", "INFC_EP_GATHER"]]))
def test_nccl_collectives_pack_the_owners_rows(fake_device, world, T, split, gather, rng, monkeypatch):
    """NcclCollectives around a communicator: ep_dispatch's pack / all_gather / unpack gives the
    owners' rows (T not a multiple of the world, fewer tokens than ranks, one rank), all_gather
    along axis 1 lands every rank's columns in place; fp32 partials summed and rounded once, by
    one all-reduce or (split: every size past rs_ag_bytes) by reduce-scatter + all-gather where
    the ranks split T * H evenly (T * H = 280: two ranks and one, not three)."""
    C = fake_device.collectives
    ctx = FakeCtx(4 << 20)
    comms = FakeComms(ctx, world)
    if gather:
        monkeypatch.setenv("INFC_EP_GATHER", "1")
    colls = [C.NcclCollectives(comms.comm(r), ctx) for r in range(world)]
    for c in colls:
        c.rs_ag_bytes = 0 if split else c.rs_ag_bytes
    for cls in collective_launches(fake_device, ctx, world, T):
        ins = fill_inputs(ctx, rng, cls, T, world)
        fires = [c.bind(cl) for c, cl in zip(colls, cls)]
        in_rank_threads(comms, [lambda f=f: f(step_dims(T, world)) for f in fires])
        check_outputs(ctx, cls, ins, T)
    # ep_dispatch gathered ceil(T / world) rows of H per rank; all_reduce / ep_combine T * H;
    # the replicated dispatch moved nothing (unless INFC_EP_GATHER): rank 0 gathered for the
    # other dispatch, both all_gathers and a split partials' sum, not once more
    m = -(-T // world)
    rs = split and (T * H) % world == 0
    assert ("all_gather", 0, m * H) in comms.calls and ("all_reduce", 0, T * H) in comms.calls
    # dp_dispatch gathers x, weights and ids (T rows of each a rank); dp_combine reduce-scatters
    assert sum(c[:2] == ("all_gather", 0) for c in comms.calls) == 3 + rs + gather + 3
    assert ("all_gather", 0, T * K) in comms.calls and ("reduce_scatter", 0, T * H) in comms.calls
    # all_reduce, ep_combine and the fp32 partials (reduced in fp32, then rounded by the cast
    # helper), or the partials by reduce-scatter
    assert sum(c == ("all_reduce", 0, T * H) for c in comms.calls) == (2 if rs else 3)
    # ... and dp_combine's
    assert sum(c[:2] == ("reduce_scatter", 0) for c in comms.calls) == rs + 1


# -- the lockstep driver over whole rank plans -------------------------------------------------------
class FakeGraph:
    """A 'captured' graph: records nothing at capture, replays the recording function on launch
    (the dims and pointers are the capture's, as a real graph's are)."""
    captured = []
    replays = 0

    def __init__(self, ctx, record):
        self.record = record
        FakeGraph.captured.append(self)

    def launch(self):
        FakeGraph.replays += 1
        self.record()


def _read(ctx, b: "object", dims):
    shape = [dims[d] if isinstance(d, str) else d for d in b.shape]
    return ctx.get(b.ptr, shape, b.dtype)


def _check_every_collective(ctx, group) -> list:
    """Hold every collective the group issues (each step's, graph replays included) to the numpy
    reference's bits; -> the list of the ops checked so far."""
    checked = []

    def observe(op, cls, dims):
        ins = [[_read(ctx, b, dims) for b in c.inputs] for c in cls]
        want = _ref(op, ins, cls[0].attrs, len(cls))
        for r, c in enumerate(cls):
            for i, o in enumerate(c.outputs):
                _assert_bits(_read(ctx, o, dims), want[r][i], o.dtype, f"{c.where} rank {r}")
        checked.append(op)

    group.observe = observe
    return checked


# the MoE ranks' rendered kernels and expert collectives on the fake device: --exhaustive (the
# expert-parallel exchange is checked against the reference ranks in tests/test_parallel.py and over
# two processes in tests/test_rank_workers.py in the fast suite)
@pytest.mark.parametrize("family,par", [("qwen3", dict(tensor_parallel_size=2)),
                                        pytest.param("qwen3_moe", dict(tensor_parallel_size=2, enable_expert_parallel=True),
                                                     marks=EXHAUSTIVE)],
                         ids=["qwen3-tp2", "qwen3_moe-tp2-ep2"])
def test_lockstep_ranks_on_a_fake_device(fake_device, artifacts, monkeypatch, family, par, rng):
    from infc.runtime.reference.ranks import RankExecutor
    from infc.compiler.contract.safetensors_io import Checkpoint
    from infc.runtime.engine.step import Chunk, build_step
    from infc.runtime.weights.load import load_weights
    monkeypatch.setattr(fake_device.driver, "Graph", FakeGraph)
    d, art = artifacts(family, **par)
    ctx = FakeCtx(24 << 20)
    ranks = fake_device.ranks.DeviceCopyRanks(art, d, num_pages=8, max_num_batched_tokens=16,
                                              max_num_seqs=2, buckets=[1, 2], ctx=ctx)
    assert ranks.world == 2 and [r.plan["parallel"]["rank"] for r in ranks.runners] == [0, 1]
    assert len(FakeGraph.captured) >= 2 and ranks.graphs.keys() == {1, 2}
    checked = _check_every_collective(ctx, ranks.group)
    plans = [r.plan for r in ranks.runners]
    ref = RankExecutor(plans, [load_weights(p, Checkpoint(d)) for p in plans])
    pages, page_size = {}, ranks.page_size
    free = list(range(ranks.num_pages))

    def run(chunks):
        for c in chunks:
            need = -(-(c.start + len(c.tokens)) // page_size)
            pages.setdefault(c.seq_id, [])
            while len(pages[c.seq_id]) < need:
                pages[c.seq_id].append(free.pop())
        got = ranks.logits(build_step(chunks, pages.__getitem__, page_size)).copy()
        want = ref.step(chunks)
        assert np.array_equal(ranks.rank_logits[1], ranks.rank_logits[0])   # the same bits on every rank
        err = float(np.abs(got - want).max())
        print(f"step {[(c.seq_id, len(c.tokens), c.start) for c in chunks]}: max |logit| "
              f"{float(np.abs(want).max()):.3f}, max err {err:.4f}")
        assert err <= 0.02 * float(np.abs(want).max()) + 1e-3, (err, float(np.abs(want).max()))   # bf16
        return got

    prompt = [int(t) for t in rng.integers(0, 320, 9)]
    run([Chunk(0, prompt, 0)])                                 # prefill (the short program)
    n_eager = len(checked)
    assert n_eager >= 6 and "all_reduce" in checked
    if family == "qwen3_moe":
        assert {"ep_dispatch", "ep_combine"} <= set(checked)
    replays = FakeGraph.replays
    for pos in range(9, 12):                                   # decode: the bucket-1 graph replays
        run([Chunk(0, [int(rng.integers(0, 320))], pos)])
    assert FakeGraph.replays == replays + 3 and len(checked) == 4 * n_eager
    run([Chunk(0, [5], 12), Chunk(1, [int(t) for t in rng.integers(0, 320, 4)], 0)])     # mixed
    ranks.close()
    assert ctx.stream is None


@EXHAUSTIVE       # the fast suite checks data parallelism on the reference ranks (tests/test_data_parallel.py)
def test_data_parallel_ranks_on_a_fake_device(fake_device, artifacts, monkeypatch, rng):
    """Attention data-parallel ranks (each its own sequences, the experts over every rank's
    rows): the rendered kernels over G = 2 * T rows and the device-copy dp_dispatch / dp_combine,
    step by step against the reference ranks (runtime/reference/ranks.py) on the same padded
    steps; the ranks' steps differ in sequences, B and phase."""
    from infc.runtime.reference.ranks import RankExecutor
    from infc.compiler.contract.safetensors_io import Checkpoint
    from infc.runtime.engine.step import Chunk, build_step, pad_ranks
    from infc.runtime.weights.load import load_weights
    monkeypatch.setattr(fake_device.driver, "Graph", FakeGraph)
    d, art = artifacts("qwen3_moe", data_parallel_size=2, enable_expert_parallel=True)
    ctx = FakeCtx(24 << 20)
    ranks = fake_device.ranks.DeviceCopyRanks(art, d, num_pages=8, max_num_batched_tokens=16,
                                              max_num_seqs=4, buckets=[1, 2], ctx=ctx)
    assert [r.plan["parallel"]["dp"] for r in ranks.runners] == [2, 2]
    checked = _check_every_collective(ctx, ranks.group)
    plans = [r.plan for r in ranks.runners]
    ref = RankExecutor(plans, [load_weights(p, Checkpoint(d)) for p in plans])
    ref.allocate_pages(ranks.num_pages + 1, ranks.page_size)
    spare = ranks.num_pages                       # pad rows write the spare page, as graph pads do
    page_size = ranks.page_size
    pages = [{}, {}]
    free = [list(range(ranks.num_pages)), list(range(ranks.num_pages))]

    def run(per_rank):
        metas = []
        for r, chunks in enumerate(per_rank):
            for c in chunks:
                need = -(-(c.start + len(c.tokens)) // page_size)
                pages[r].setdefault(c.seq_id, [])
                while len(pages[r][c.seq_id]) < need:
                    pages[r][c.seq_id].append(free[r].pop())
            metas.append(build_step(chunks, pages[r].__getitem__, page_size, max_pages=4))
        metas = pad_ranks(metas, spare, page_size)
        got = [g.copy() for g in ranks.logits_ranks(metas)]
        want = ref.step_paged_ranks(metas)
        for r, chunks in enumerate(per_rank):
            if not chunks:
                continue
            g, w = got[r][:len(chunks)], want[r][:len(chunks)]
            err = float(np.abs(g - w).max())
            assert err <= 0.02 * float(np.abs(w).max()) + 1e-3, (r, err, float(np.abs(w).max()))   # bf16

    a = [int(t) for t in rng.integers(0, 320, 9)]
    b = [int(t) for t in rng.integers(0, 320, 4)]
    run([[Chunk(0, a, 0)], [Chunk(0, b, 0)]])                       # prefill 9 / 4 (+ a 5-token pad)
    assert {"dp_dispatch", "dp_combine"} <= set(checked)
    replays = FakeGraph.replays
    run([[Chunk(0, [5], 9)], [Chunk(0, [6], 4)]])                   # decode: the bucket-1 graph
    assert FakeGraph.replays == replays + 1
    run([[Chunk(0, [7], 10)], [Chunk(0, [8], 5), Chunk(1, [1, 2, 3], 0)]])   # decode | mixed
    run([[], [Chunk(0, [9], 6), Chunk(1, [4], 3)]])                 # rank 0 idle: pad rows only
    assert checked.count("dp_dispatch") == checked.count("dp_combine") >= 4
    ranks.close()


# -- one process per GPU: what each rank's runner agrees on and gives back ----------------------
class MinComms(FakeComms):
    """FakeComms with all_reduce's `op` (the page agreement's "min"), and abort."""

    def comm(self, rank):
        c = super().comm(rank)
        c.all_reduce = lambda *a, op="sum": self.all_reduce_op(rank, op, *a)
        c.released = None

        def release(how):
            c.released = how
            c.stream_at_release = self.ctx.stream
        c.abort, c.destroy = (lambda: release("abort")), (lambda: release("destroy"))
        return c

    def all_reduce_op(self, rank, op, send, recv, count, dtype, stream):
        if op == "sum":
            return self.all_reduce(rank, send, recv, count, dtype, stream)
        assert op == "min" and dtype == "i32"
        self.slots[rank] = self.ctx.get(send, [count], dtype).copy()
        self.barrier.wait()
        low = np.minimum.reduce([np.asarray(s) for s in self.slots])
        self.barrier.wait()
        self.ctx.put(recv, low, dtype)


def test_ranks_agree_on_the_smallest_page_count(fake_device):
    """Each process sizes its KV cache from its own GPU's free memory (a few MB apart between
    GPUs); every rank must hold the same page ids, so they take the smallest (agreed_min)."""
    ctx = FakeCtx(1 << 20)
    comms = MinComms(ctx, 3)
    mine = {0: 5000, 1: 4987, 2: 5003}
    got = {}

    def run(r):
        got[r] = fake_device.ranks.agreed_min(comms.comm(r), ctx, mine[r])
    threads = [threading.Thread(target=run, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == {0: 4987, 1: 4987, 2: 4987}


def test_a_rank_runner_sizes_its_cache_by_agreement_and_aborts_its_communicator(fake_device, artifacts, rng):
    """CudaRunner(agree_num_pages=...) allocates the agreed page count, not its own; close()
    destroys the communicator when the ranks close together, aborts it after a failure; the
    context (the graphs that captured NCCL calls) is closed before the communicator."""
    import json
    d, art = artifacts("qwen3", tensor_parallel_size=2)
    plan = json.loads((art / "plan.rank0.json").read_text())
    ctx = FakeCtx(24 << 20)
    comm = MinComms(ctx, 1).comm(0)
    comm.world, comm.rank = 2, 0                   # rank 0 of 2; the agreement is the hook's
    seen = []

    def agree(n):
        seen.append(n)
        return n - 7
    r = fake_device.runner.CudaRunner(art, d, max_num_batched_tokens=16, max_num_seqs=2,
                                      cuda_graphs=False, ctx=ctx, plan=plan,
                                      collectives=fake_device.collectives.NcclCollectives(comm, ctx),
                                      agree_num_pages=agree)
    assert len(seen) == 1 and seen[0] > 7 and r.num_pages == seen[0] - 7
    assert r.caches.num_pages == r.num_pages
    r.close()
    assert comm.released == "destroy" and ctx.stream is None
    assert comm.stream_at_release is None      # the graphs (and all else) were given back first
    coll = fake_device.collectives.NcclCollectives(comm, ctx)
    coll.close(graceful=False)
    assert comm.released == "abort"
