"""Load a built artifact (plan.json + bin/*.cubin + bin/*.json) onto the GPU: modules, kernel
functions with their launch shapes. (The weights: weights.py.)"""
import json
from pathlib import Path


from infc.compiler.errors import ModelDirError

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
