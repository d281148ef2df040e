"""The plan's weights onto the GPU, straight from the safetensors files.

Every weight is laid out in one device allocation (256-byte aligned); a per-layer weight has one
copy per entry of its `layers`, in that order. A weight whose recipe is a bf16 tensor, bf16
tensors stacked or concatenated along axis 0, or rows (axis 0) sliced from such, is a run of file
byte ranges laid end to end: those are read with pread (several threads, no page faults through
a mapping) into one of two pinned staging buffers while the other one's copy to the device runs.
Any other recipe (another dtype, another axis, transpose, scale, offset, zeros) is built on the
host by the recipe registry (runtime/weights/recipes.py) in float32, rounded once to bf16 (to
nearest even) and copied through the same buffers. A weight the plan declares f32 (a spec's
`dtype: f32`, e.g. Qwen3.5's A = -exp(A_log)) is always built that way and kept in float32.
The staging memory is given back at the end, so a loaded server's resident memory is the
Python process, not the model.

With load_format="dummy" no file is read: the same layout is allocated and each weight region is
filled on the device by the plan's fill_random kernel (plan["weight_init"], and
plan["weight_init_f32"] for f32 weights; values and seeds: runtime/weights/dummy.py), so a model
is benchmarked without its checkpoint and without any host staging.
"""
import bisect
import math
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from infc.compiler.contract.errors import ModelDirError

from infc.compiler.contract.bind import Resolver, grid
from infc.compiler.contract.schema import DTYPE_BYTES
from ..weights.dummy import check_load_format, chunks, rule, seed_of
from infc.compiler.contract.safetensors_io import Checkpoint, f32_to_bf16_bits
from ..weights.recipes import build, name_at
from ..weights.load import check_shape, layers_of

ALIGN = 256
STORED_DTYPES = ("bf16", "f32")        # the weight dtypes the GPU path stores
STAGING = 256 << 20
PIECE = 16 << 20                       # one pread


def _cut(runs: list, lo: int, hi: int) -> list:
    """The byte ranges [lo, hi) of a run list read end to end."""
    out, pos = [], 0
    for f, off, n in runs:
        a, b = max(lo, pos), min(hi, pos + n)
        if a < b:
            out.append((f, off + a - pos, b - a))
        pos += n
    return out


def _runs(ckpt: Checkpoint, src: dict, layer):
    """(file byte ranges, shape, what) when the weight is bf16 bytes laid end to end, else None."""
    if "tensor" in src:
        name = name_at(src["tensor"], layer)
        f, dtype, off, n = ckpt.locate(name)
        if dtype != "BF16":
            return None
        return [(f, off, n)], tuple(ckpt.shape(name)), name
    if "stack" in src:
        parts = [_runs(ckpt, {"tensor": name_at(src["stack"], layer, e)}, None) for e in range(src["count"])]
        if any(p is None for p in parts) or len({p[1] for p in parts}) != 1:
            return None               # numpy builds it (and names a shape mismatch)
        return [r for p in parts for r in p[0]], (len(parts), *parts[0][1]), name_at(src["stack"], layer)
    if "concat" in src and src["axis"] == 0:
        parts = [_runs(ckpt, s, layer) for s in src["concat"]]
        if any(p is None for p in parts) or len({p[1][1:] for p in parts}) != 1:
            return None
        shape = (sum(p[1][0] for p in parts), *parts[0][1][1:])
        return [r for p in parts for r in p[0]], shape, " + ".join(p[2] for p in parts)
    if "slice" in src and src["axis"] == 0 and src.get("groups", 1) == 1:
        got = _runs(ckpt, src["slice"], layer)
        if got is None or not 0 <= src["start"] < src["stop"] <= got[1][0]:
            return None               # numpy builds it (and names a bad range)
        runs, shape, what = got
        row = 2 * int(np.prod(shape[1:], dtype=np.int64))
        return (_cut(runs, src["start"] * row, src["stop"] * row), (src["stop"] - src["start"], *shape[1:]),
                f"{what}[{src['start']}:{src['stop']}]")
    return None


class DeviceWeights:
    """name -> device pointer (or a list of per-layer pointers); `bytes` is their total size."""

    def __init__(self, ctx, plan: dict, model_dir: Path, progress: bool = True, threads: int = 8,
                 load_format: str = "auto", fill=None, seed: int = 0):
        """fill: the loaded weight_init kernel (or {dtype: kernel}: plan["weight_init"] for bf16,
        plan["weight_init_f32"] for f32), needed for load_format="dummy"."""
        dummy = check_load_format(load_format) == "dummy"
        fills = fill if isinstance(fill, dict) else {"bf16": fill}
        if dummy:
            for dtype in sorted({w["dtype"] for w in plan["weights"].values() if "tied" not in w["source"]}):
                if dtype in STORED_DTYPES and fills.get(dtype) is None:   # others: refused below
                    key = "weight_init" if dtype == "bf16" else f"weight_init_{dtype}"
                    raise ModelDirError(f"--load-format dummy needs the artifact's {dtype} weight fill "
                                        f"kernel (plan['{key}']): rebuild the artifact with this infc")
        ckpt = None if dummy else Checkpoint(model_dir)
        self.ptrs: dict = {}
        self.bytes = 0
        self.layers = {}               # per-layer weight -> its global layer indices
        items, tied = [], []           # (name, layer, runs | array)
        for name, w in plan["weights"].items():
            if "tied" in w["source"]:
                tied.append((name, w["source"]["tied"]))
                continue
            if w["dtype"] not in STORED_DTYPES:
                raise ModelDirError(f"weight '{name}': only bf16 and f32 weights are supported on the "
                                    f"GPU, not {w['dtype']}")
            f32 = w["dtype"] == "f32"
            if w["layers"] is not None:
                self.layers[name] = list(w["layers"])
            for layer in layers_of(w):
                if dummy:                       # bytes only: filled on the device below
                    items.append((name, layer, DTYPE_BYTES[w["dtype"]] * math.prod(w["shape"])))
                    continue
                got = None if f32 else _runs(ckpt, w["source"], layer)
                if got is None:
                    a, what = build(w["source"], layer, ckpt.float32, str(ckpt.dir))
                    bits = np.ascontiguousarray(a, np.float32) if f32 else f32_to_bf16_bits(a)
                    data, shape = bits.view(np.uint8).reshape(-1), tuple(a.shape)
                else:
                    data, shape, what = got
                check_shape(ckpt, name, w, shape, what)
                items.append((name, layer, data))

        # layout: one allocation, each weight aligned; segments in device order
        segs, placed, pos = [], [], 0          # segs: (dst offset, length, source)
        for name, layer, data in items:
            placed.append((name, layer, pos))
            start = pos
            for src in (data if isinstance(data, list) else [data]):
                n = src if isinstance(src, int) else src[2] if isinstance(src, tuple) else src.nbytes
                segs.append((pos, n, src))
                pos += n
            self.bytes += pos - start
            pos = -(-pos // ALIGN) * ALIGN
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
        if dummy:
            self._fill(ctx, plan, placed, fills, seed)
        else:
            try:
                self._stream(ctx, segs, pos, threads, progress)
            finally:
                ckpt.close()
        self.load_s = time.perf_counter() - t0

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

    def _fill(self, ctx, plan: dict, placed: list, fills: dict, seed: int):
        """One fill launch per weight region (per 2^30-element chunk of a larger one), with the
        fill kernel of the weight's dtype."""
        for name, layer, off in placed:
            w = plan["weights"][name]
            kernel, size = fills[w["dtype"]], DTYPE_BYTES[w["dtype"]]
            scale, offset = rule(w)
            for start, n, c in chunks(math.prod(w["shape"])):
                named = {"seed": seed_of(name, layer, c, seed), "scale": scale, "offset": offset}
                ptr = self.base + off + size * start
                values = Resolver(tensor=lambda *_: ptr, dim={"N": n}.__getitem__,
                                  arg=named.__getitem__).values(kernel.meta, outputs=[name], kernel=kernel.id)
                _launch(ctx, kernel, grid(kernel.meta, {"N": n}), kernel.pack(values))
        ctx.sync()

    def _stream(self, ctx, segs, total: int, threads: int, progress: bool):
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
            view, f, off = job
            got = 0
            while got < len(view):
                n = os.preadv(fd(f), [view[got:]], off + got)
                if n <= 0:
                    raise ModelDirError(f"{f.path}: truncated (a tensor's bytes end past the file)")
                got += n

        t0 = time.perf_counter()
        try:
            with ThreadPoolExecutor(threads) as pool:
                for k, lo in enumerate(range(0, total, size)):
                    hi = min(lo + size, total)
                    b = k % 2
                    if done[b] is not None:
                        done[b].wait()
                    buf = memoryview(bufs[b])
                    jobs = []
                    i = max(bisect.bisect_right(starts, lo) - 1, 0)
                    while i < len(segs) and segs[i][0] < hi:
                        dst, n, src = segs[i]
                        a, z = max(dst, lo), min(dst + n, hi)
                        if a < z:
                            if isinstance(src, tuple):
                                f, off, _ = src
                                for p in range(a, z, PIECE):
                                    q = min(p + PIECE, z)
                                    jobs.append((buf[p - lo: q - lo], f, off + (p - dst)))
                            else:
                                bufs[b][a - lo: z - lo] = src[a - dst: z - dst]
                        i += 1
                    list(pool.map(read, jobs))
                    ctx.htod_raw(self.base + lo, bufs[b].ctypes.data, hi - lo)
                    done[b] = ctx.event()
                    done[b].record()
                    if progress and sys.stderr.isatty():
                        sys.stderr.write(f"\r  weights {hi / 2**30:6.2f} / {total / 2**30:.2f} GiB "
                                         f"{time.perf_counter() - t0:5.1f} s")
            ctx.sync()
        finally:
            for f in fds.values():
                os.close(f)
            ctx.sync()
            for buf in bufs:
                ctx.free_pinned(buf)
        if progress and sys.stderr.isatty():
            sys.stderr.write("\n")


def _launch(ctx, kernel, g, args):
    from .driver import launch             # cuda-python only when a GPU fill really runs
    launch(ctx, kernel.fn, g, kernel.block, kernel.shared, args)
