"""Load a built artifact (plan.json + bin/*.cubin + bin/*.json) onto the GPU: modules, kernel
functions with their launch shapes, and the weights through pinned staging."""
import json
import sys
import time
from pathlib import Path

import numpy as np

from infc.compiler.errors import ModelDirError

from ..safetensors_io import Checkpoint
from ..weights import iter_weights
from .driver import Module

DTYPE_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "i32": 4}


class KernelFn:
    def __init__(self, kid: str, meta: dict, info: dict, fn):
        self.id, self.meta, self.info, self.fn = kid, meta, info, fn
        self.block = tuple(info.get("block") or meta.get("block") or [info["num_warps"] * 32, 1, 1])
        # dynamic shared memory to launch with: Triton reports it as `shared`; the nvcc-built
        # backends report static `shared` and `dynamic_shared` apart
        self.shared = int(info["dynamic_shared"] if "dynamic_shared" in info else info.get("shared", 0))
        self.hidden_args = int(info.get("hidden_args", 0))
        self.global_scratch = int(info.get("global_scratch_size", 0))


def load_plan(artifact: Path) -> dict:
    try:
        return json.loads((Path(artifact) / "plan.json").read_text())
    except FileNotFoundError:
        raise ModelDirError(f"{artifact}: no plan.json (run `infc build`)") from None


def load_kernels(artifact: Path, plan: dict) -> dict[str, KernelFn]:
    out = {}
    for kid, meta in plan["kernels"].items():
        bin_dir = Path(artifact) / "bin"
        try:
            cubin = (bin_dir / f"{kid}.cubin").read_bytes()
            info = json.loads((bin_dir / f"{kid}.json").read_text())
        except FileNotFoundError:
            raise ModelDirError(f"{artifact}: kernel {kid} has no cubin (run `infc build`)") from None
        fn = Module(cubin).function(info["name"], int(info.get("dynamic_shared", info.get("shared", 0))))
        out[kid] = KernelFn(kid, meta, info, fn)
    return out


class DeviceWeights:
    """name -> device pointer (or a list of per-layer pointers)."""

    def __init__(self, ctx, plan: dict, model_dir: Path, progress: bool = True):
        self.ptrs: dict = {}
        self.bytes = 0
        ckpt = Checkpoint(model_dir)
        total = sum(int(np.prod(w["shape"])) * DTYPE_BYTES[w["dtype"]] * (plan["config"].get("L", 1) if w["per_layer"] else 1)
                    for w in plan["weights"].values() if "tied" not in w["source"])
        staging = ctx.pinned(max(int(np.prod(w["shape"])) * 4 for w in plan["weights"].values()))
        t0, done, tied = time.perf_counter(), 0, []

        def read(name):
            return ckpt.bf16_bits(name)

        for name, layer, a in iter_weights(plan, ckpt, read):
            if isinstance(a, str):
                tied.append((name, a))
                continue
            if plan["weights"][name]["dtype"] != "bf16":
                raise ModelDirError(f"weight '{name}': only bf16 weights are supported on the GPU")
            buf = staging[: a.nbytes]
            buf[:] = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
            ptr = ctx.alloc(a.nbytes)
            ctx.htod(ptr, buf)
            ctx.sync()                          # the staging buffer is reused next
            if layer is None:
                self.ptrs[name] = ptr
            else:
                self.ptrs.setdefault(name, []).append(ptr)
            self.bytes += a.nbytes
            done += a.nbytes
            if progress and sys.stderr.isatty():
                sys.stderr.write(f"\r  weights {done / 2**30:6.2f} / {total / 2**30:.2f} GiB "
                                 f"{time.perf_counter() - t0:5.1f} s")
        for name, target in tied:
            self.ptrs[name] = self.ptrs[target]
        if progress and sys.stderr.isatty():
            sys.stderr.write("\n")
