"""The plan's weights onto the GPU, straight from the safetensors files.

Every weight is laid out in one device allocation (256-byte aligned); a per-layer weight has one
copy per entry of its `layers`, in that order. A weight whose recipe is a bf16 tensor, bf16
tensors stacked or concatenated along axis 0, or rows (axis 0) sliced from such, is a run of file
byte ranges laid end to end: those are read with pread (several threads, no page faults through
a mapping) into one of two pinned staging buffers while the other one's copy to the device runs.
So is a quantized checkpoint's fp8 weight read by `{"fp8": name}` from F8_E4M3 bytes (or those
stacked as experts, concatenated / sliced along axis 0): its file bytes are already the e4m3 storage form, checked
for NaN codes (0x7f / 0xff) as they pass through the staging buffer.
Any other recipe (another dtype, another axis, transpose, scale, offset, zeros) is built on the
host by the recipe registry (runtime/weights/recipes.py) in float32, rounded once to bf16 (to
nearest even) and copied through the same buffers. A weight the plan declares f32 (a spec's
`dtype: f32`, e.g. Qwen3.5's A = -exp(A_log); a quantized linear's scales and zero points) is
always built that way and kept in float32; i32 (a quantized linear's group indices) as int32;
other quantized codes (u8, u4, e2m1, fp8 read another way) are built in the canonical form
(codes as the values they encode, compiler/quant/scheme.py) and packed to their storage bytes
(runtime/weights/quant_pack.py). Sizes are the plan contract's (schema.nbytes: u4 / e2m1 pack
two codes a byte). The staging memory is given back at the end, so a loaded server's resident
memory is the Python process, not the model.

With load_format="dummy" no file is read: the same layout is allocated and each weight region is
filled on the device by the plan's fill_random kernel of the weight's fill kind (plan["weight_init"]
for bf16, plan["weight_init_<kind>"] for the others: compiler/contract/weight_roles.py; values
and seeds: runtime/weights/dummy.py), so a model is benchmarked without its checkpoint and
without any host staging.
"""
import bisect
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from infc.compiler.contract.errors import ModelDirError

from infc.compiler.contract.bind import Resolver, grid
from infc.compiler.contract.schema import DTYPE_BYTES, nbytes
from infc.compiler.contract.weight_roles import (FILL_KINDS, fill_key, fill_kind, fill_kinds, is_derived,
                                                is_mx_scale, quant_roles)
from ..weights.dummy import check_load_format, chunks, fill_args, fill_elements
from infc.compiler.contract.safetensors_io import Checkpoint, f32_to_bf16_bits
from ..weights.quant_pack import to_storage
from ..weights.recipes import CheckpointReader, build, kind_of, name_at
from ..weights.load import check_shape, layers_of

ALIGN = 256
# the weight dtypes the GPU path stores: bf16, f32, and a quantized linear's codes and companions
STORED_DTYPES = ("bf16", "f32", "i32", "f8e4m3", "u8", "u4", "e2m1")
# plan dtype -> (the recipe leaf, the safetensors dtype, bytes an element) whose file bytes are
# already the storage form: streamed without a host conversion (_runs)
STREAMED = {"bf16": ("tensor", "BF16", 2), "f8e4m3": ("fp8", "F8_E4M3", 1)}
STAGING = 256 << 20
PIECE = 16 << 20                       # one pread
# recipe kinds that only move elements: a bf16 weight built from bf16 tensors by these alone is
# built on the tensors' bits (uint16), the bytes the float32 path rounds back to (bf16 -> float32
# -> bf16 is exact; a NaN keeps its stored payload), without the float32 copies and the rounding
# pass: 5.7x faster here for GPT-OSS's transposed experts (qwen3_moe's gate|up concatenated along
# columns and DeepSeek's reshaped experts too; most of a golden-gate runner's load: bench/NOTES.md)
MOVES = {"tensor", "stack", "concat", "slice", "reshape", "transpose"}


def _moves_only(src) -> bool:
    if isinstance(src, str):            # a stack's tensor name
        return True
    kind = kind_of(src)
    if kind not in MOVES:
        return False
    inner = src[kind]
    return kind == "tensor" or (all(map(_moves_only, inner)) if kind == "concat" else _moves_only(inner))


class _NotBf16(Exception):
    pass


class _Bf16Bits(CheckpointReader):
    """read(name) -> the tensor's bf16 bits as stored (uint16); another dtype raises _NotBf16."""

    def __call__(self, name: str) -> np.ndarray:
        if self.ckpt.dtype(name) != "BF16":
            raise _NotBf16(name)
        return self.ckpt.raw(name)


def _bf16_moved(w: dict, layer, ckpt) -> tuple | None:
    """(bytes, shape, what) of a bf16 weight whose recipe only moves bf16 tensors, else None
    (the form of _runs' answer: the loader lays both out alike)."""
    if w["dtype"] != "bf16" or not _moves_only(w["source"]):
        return None
    try:
        a, what = build(w["source"], layer, _Bf16Bits(ckpt), str(ckpt.dir))
    except _NotBf16:
        return None
    return np.ascontiguousarray(a).view(np.uint8).reshape(-1), a.shape, what


def _cut(runs: list, lo: int, hi: int) -> list:
    """The byte ranges [lo, hi) of a run list read end to end."""
    out, pos = [], 0
    for f, off, n in runs:
        a, b = max(lo, pos), min(hi, pos + n)
        if a < b:
            out.append((f, off + a - pos, b - a))
        pos += n
    return out


def _runs(ckpt: Checkpoint, src: dict, layer, dtype: str = "bf16"):
    """(file byte ranges, shape, what) when the weight is `dtype` file bytes laid end to end
    (STREAMED), else None."""
    leaf, stored, size = STREAMED[dtype]
    if leaf in src:
        name = name_at(src[leaf], layer)
        f, got, off, n = ckpt.locate(name)
        if got != stored:
            return None
        return [(f, off, n)], tuple(ckpt.shape(name)), name
    if "stack" in src and leaf == "tensor" and isinstance(src["stack"], str):
        parts = [_runs(ckpt, {"tensor": name_at(src["stack"], layer, e)}, None) for e in range(src["count"])]
        if any(p is None for p in parts) or len({p[1] for p in parts}) != 1:
            return None               # numpy builds it (and names a shape mismatch)
        return [r for p in parts for r in p[0]], (len(parts), *parts[0][1]), name_at(src["stack"], layer)
    if "stack" in src and isinstance(src["stack"], dict) and set(src["stack"]) == {leaf}:
        # a quantized checkpoint's experts, each a streamed leaf ({"fp8": name}) of its own
        pattern = src["stack"][leaf]
        parts = [_runs(ckpt, {leaf: name_at(pattern, layer, e)}, None, dtype) for e in range(src["count"])]
        if any(p is None for p in parts) or len({p[1] for p in parts}) != 1:
            return None
        return [r for p in parts for r in p[0]], (len(parts), *parts[0][1]), name_at(pattern, layer)
    if "concat" in src and src["axis"] == 0:
        parts = [_runs(ckpt, s, layer, dtype) for s in src["concat"]]
        if any(p is None for p in parts) or len({p[1][1:] for p in parts}) != 1:
            return None
        shape = (sum(p[1][0] for p in parts), *parts[0][1][1:])
        return [r for p in parts for r in p[0]], shape, " + ".join(p[2] for p in parts)
    if "slice" in src and src["axis"] == 0 and src.get("groups", 1) == 1:
        got = _runs(ckpt, src["slice"], layer, dtype)
        if got is None or not 0 <= src["start"] < src["stop"] <= got[1][0]:
            return None               # numpy builds it (and names a bad range)
        runs, shape, what = got
        row = size * int(np.prod(shape[1:], dtype=np.int64))
        return (_cut(runs, src["start"] * row, src["stop"] * row), (src["stop"] - src["start"], *shape[1:]),
                f"{what}[{src['start']}:{src['stop']}]")
    return None


def _built(w: dict, a: np.ndarray) -> np.ndarray:
    """A weight built in float32 by the recipes, as the bytes the device holds."""
    dtype = w["dtype"]
    if dtype == "bf16":
        return f32_to_bf16_bits(a)
    if dtype == "f32":
        return np.ascontiguousarray(a, np.float32)
    if dtype == "i32":
        if a.size and not np.array_equal(a, np.round(a)):
            raise ValueError("group indices must be integers")
        return np.ascontiguousarray(a, np.int32)
    return to_storage(a, dtype)


def _nan_codes(view, where: str):
    """e4m3 bytes streamed from a file: 0x7f / 0xff are NaN, which no quantizer writes."""
    v = np.frombuffer(view, np.uint8)
    if ((v & np.uint8(0x7F)) == np.uint8(0x7F)).any():
        raise ModelDirError(f"{where} holds NaN codes (e4m3 0x7f/0xff)")


def _check_mx_scale(role, a: np.ndarray, where: str):
    """An MXFP4 scale (e2m1 codes, a scale a row and 32 columns) must be a power of two: the MoE
    decode kernels hand it to tl.dot_scaled as its e8m0 exponent byte (triton/_quant.j2 _w_e8m0).
    e8m0 checkpoints are; a float scale tensor (fp8's expert_dtype fp4 without ue8m0) may not be."""
    if not is_mx_scale(role):
        return
    m, _ = np.frexp(np.asarray(a, np.float32))
    if not (m == 0.5).all():
        raise ModelDirError(f"{where} holds MXFP4 scales that are not powers of two (e8m0): the fp4 "
                            f"experts run on e8m0 scales")


class DeviceWeights:
    """name -> device pointer (or a list of per-layer pointers); `bytes` is their total size."""

    def __init__(self, ctx, plan: dict, model_dir: Path, progress: bool = True, threads: int = 8,
                 load_format: str = "auto", fill=None, seed: int = 0, shared: dict | None = None,
                 background: bool = False):
        """fill: the loaded weight_init kernel (or {fill kind: kernel}: plan["weight_init"] for
        bf16, plan["weight_init_<kind>"] for the others), needed for load_format="dummy".
        shared: model-level weight name -> the device pointer of another runner's copy, used as
        it is (neither read nor filled here; the caller checked its shape and dtype).
        background: read and copy a checkpoint's bytes in a thread of their own, on a stream of
        their own, while the caller allocates its caches and captures its graphs; the
        allocation is zeroed first, so kernels run meanwhile read finite values. wait() before
        anything whose result is kept reads a weight (the runner: before its load program)."""
        shared = shared or {}
        dummy = check_load_format(load_format) == "dummy"
        fills = fill if isinstance(fill, dict) else {"bf16": fill}
        roles = quant_roles(plan)
        if dummy:
            for kind in fill_kinds(plan):
                if fills.get(kind) is None:
                    raise ModelDirError(f"--load-format dummy needs the artifact's {kind} weight fill "
                                        f"kernel (plan['{fill_key(kind)}']): rebuild the artifact with this infc")
        ckpt = None if dummy else Checkpoint(model_dir)
        read = None if dummy else CheckpointReader(ckpt)
        self.ptrs: dict = {}
        self.bytes = 0
        self.layers = {}               # per-layer weight -> its global layer indices
        items, tied = [], []           # (name, layer, runs | array | bytes, NaN check name)
        derived = []                   # (name, layer, bytes): laid out after the rest
        for name, w in plan["weights"].items():
            if name in shared:
                if w["layers"] is not None:
                    raise ValueError(f"weight '{name}': only a model-level weight can be shared")
                self.ptrs[name] = shared[name]
                continue
            if "tied" in w["source"]:
                tied.append((name, w["source"]["tied"]))
                continue
            if w["dtype"] not in STORED_DTYPES:
                raise ModelDirError(f"weight '{name}': the GPU stores {', '.join(STORED_DTYPES)} weights, "
                                    f"not {w['dtype']}")
            if w["layers"] is not None:
                self.layers[name] = list(w["layers"])
            for layer in layers_of(w):
                if is_derived(w["source"]):     # the load program writes it: only its room, last
                    derived.append((name, layer, nbytes(w["dtype"], w["shape"])))
                    continue
                if dummy:                       # bytes only: filled on the device below
                    items.append((name, layer, nbytes(w["dtype"], w["shape"]), None))
                    continue
                # file bytes as they lie, else bf16 bits moved on the host, else built in float32
                got = (_runs(ckpt, w["source"], layer, w["dtype"]) if w["dtype"] in STREAMED else None) \
                    or _bf16_moved(w, layer, ckpt)
                if got is None:
                    a, what = build(w["source"], layer, read, str(ckpt.dir))
                    check_shape(ckpt, name, w, a.shape, what)
                    _check_mx_scale(roles.get(name), a, f"{ckpt.dir}: weight '{name}' ({what})")
                    try:
                        data = _built(w, a).view(np.uint8).reshape(-1)
                    except ValueError as e:     # values that are no codes of the plan's dtype
                        raise ModelDirError(f"{ckpt.dir}: weight '{name}' ({what}) as {w['dtype']}: {e}") from None
                    items.append((name, layer, data, None))
                else:
                    data, shape, what = got
                    check_shape(ckpt, name, w, shape, what)
                    items.append((name, layer, data, f"{ckpt.dir}: '{what}'" if w["dtype"] == "f8e4m3" else None))

        # layout: one allocation, each weight aligned; segments in device order
        segs, placed, pos = [], [], 0          # segs: (dst offset, length, source, NaN check)
        for name, layer, data, check in items:
            placed.append((name, layer, pos))
            start = pos
            for src in (data if isinstance(data, list) else [data]):
                n = src if isinstance(src, int) else src[2] if isinstance(src, tuple) else src.nbytes
                segs.append((pos, n, src, check))
                pos += n
            self.bytes += pos - start
            pos = -(-pos // ALIGN) * ALIGN
        # the derived weights lie past every streamed or filled byte: neither reads nor copies
        # reach them (GPT-OSS-20B's resident bf16 stacks are 38 GB the load program writes)
        streamed = pos
        for name, layer, n in derived:
            placed.append((name, layer, pos))
            self.bytes += n
            pos = -(-(pos + n) // ALIGN) * ALIGN
        self.base = ctx.alloc(max(pos, 1))
        for name, layer, off in placed:
            if layer is None:
                self.ptrs[name] = self.base + off
            else:
                self.ptrs.setdefault(name, []).append(self.base + off)
        for name, target in tied:
            self.ptrs[name] = self.ptrs[target]
            if target in self.layers:
                self.layers[name] = self.layers[target]
        t0 = time.perf_counter()
        self._loader, self._failure, self._stop = None, None, threading.Event()
        if dummy:
            self._fill(ctx, plan, placed[:len(items)], fills, roles, seed)
        elif background:
            ctx.memset(self.base, max(pos, 1))
            zeroed = ctx.event()
            zeroed.record()
            stream = ctx.new_stream()
            ctx.wait_event(zeroed, stream)

            def load():
                try:
                    ctx.ensure_current()
                    self._stream(ctx, segs, streamed, threads, False, stream)
                except BaseException as e:      # noqa: BLE001 - raised again by wait()
                    self._failure = e
                finally:
                    ckpt.close()
                    self.load_s = time.perf_counter() - t0
            self._loader = threading.Thread(target=load, name="infc-weights", daemon=True)
            self._loader.start()
            return
        else:
            try:
                self._stream(ctx, segs, streamed, threads, progress)
            finally:
                ckpt.close()
        self.load_s = time.perf_counter() - t0

    @property
    def loading(self) -> bool:
        """A background load not yet waited for."""
        return self._loader is not None

    def wait(self):
        """Every weight's bytes on the device (a background load joined: its error raised here)."""
        if self._loader is not None:
            self._loader.join()
            self._loader = None
            if self._failure is not None:
                raise self._failure

    def cancel(self):
        """Stop a background load at its next piece and wait for it (a runner closing early)."""
        if self._loader is not None:
            self._stop.set()
            self._loader.join()
            self._loader = None

    def ptr(self, name: str, layer) -> int:
        """Device pointer of weight `name` at global layer `layer` (ignored for model-level ones)."""
        p = self.ptrs[name]
        if not isinstance(p, list):
            return p
        try:
            return p[self.layers[name].index(layer)]
        except ValueError:
            raise KeyError(f"weight '{name}' has no copy for layer {layer} "
                           f"(its layers: {self.layers[name]})") from None

    def _fill(self, ctx, plan: dict, placed: list, fills: dict, roles: dict, seed: int):
        """One fill launch per weight region (per 2^30-element chunk of a larger one), with the
        fill kernel of the weight's fill kind."""
        for name, layer, off in placed:
            w = plan["weights"][name]
            kind = fill_kind(w, roles.get(name))
            kernel, size = fills[kind], DTYPE_BYTES[FILL_KINDS[kind][0]]
            for start, n, c in chunks(fill_elements(w, kind)):
                named = fill_args(name, w, roles.get(name), layer, start, n, c, seed)
                ptr = self.base + off + size * start
                values = Resolver(tensor=lambda *_: ptr, dim={"N": n}.__getitem__,
                                  arg=named.__getitem__).values(kernel.meta, outputs=[name], kernel=kernel.id)
                _launch(ctx, kernel, grid(kernel.meta, {"N": n}), kernel.pack(values))
        ctx.sync()

    def _stream(self, ctx, segs, total: int, threads: int, progress: bool, stream=None):
        """The checkpoint's byte runs into two pinned buffers in turn, each copied to the device on
        `stream` (default: the context's) while the other fills."""
        starts = [s[0] for s in segs]
        size = min(STAGING, max(total, 1))
        bufs = [ctx.pinned(size), ctx.pinned(size)]
        done = [None, None]            # the event after each buffer's last copy
        fds: dict = {}

        def fd(f):
            if f.path not in fds:
                fds[f.path] = os.open(f.path, os.O_RDONLY)
            return fds[f.path]

        def read(job):
            view, f, off, check = job
            got = 0
            while got < len(view):
                n = os.preadv(fd(f), [view[got:]], off + got)
                if n <= 0:
                    raise ModelDirError(f"{f.path}: truncated (a tensor's bytes end past the file)")
                got += n
            if check:
                _nan_codes(view, check)

        t0 = time.perf_counter()
        try:
            with ThreadPoolExecutor(threads) as pool:
                for k, lo in enumerate(range(0, total, size)):
                    if self._stop.is_set():
                        break
                    hi = min(lo + size, total)
                    b = k % 2
                    if done[b] is not None:
                        done[b].wait()
                    buf = memoryview(bufs[b])
                    jobs = []
                    i = max(bisect.bisect_right(starts, lo) - 1, 0)
                    while i < len(segs) and segs[i][0] < hi:
                        dst, n, src, check = segs[i]
                        a, z = max(dst, lo), min(dst + n, hi)
                        if a < z:
                            if isinstance(src, tuple):
                                f, off, _ = src
                                for p in range(a, z, PIECE):
                                    q = min(p + PIECE, z)
                                    jobs.append((buf[p - lo: q - lo], f, off + (p - dst), check))
                            else:
                                bufs[b][a - lo: z - lo] = src[a - dst: z - dst]
                        i += 1
                    list(pool.map(read, jobs))
                    ctx.htod_raw(self.base + lo, bufs[b].ctypes.data, hi - lo, stream)
                    done[b] = ctx.event()
                    done[b].record(stream)
                    if progress and sys.stderr.isatty():
                        sys.stderr.write(f"\r  weights {hi / 2**30:6.2f} / {total / 2**30:.2f} GiB "
                                         f"{time.perf_counter() - t0:5.1f} s")
            ctx.sync(stream)
        finally:
            for f in fds.values():
                os.close(f)
            ctx.sync(stream)
            for buf in bufs:
                ctx.free_pinned(buf)
        if progress and sys.stderr.isatty():
            sys.stderr.write("\n")


def _launch(ctx, kernel, g, args):
    from .driver import launch             # cuda-python only when a GPU fill really runs
    launch(ctx, kernel.fn, g, kernel.block, kernel.shared, args)
