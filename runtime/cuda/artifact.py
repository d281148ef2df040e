"""Load a built artifact (plan.json + bin/*.cubin + bin/*.json) onto the GPU: modules, kernel
functions with their launch shapes. (The weights: weights.py.)"""
import json
from pathlib import Path

from infc.compiler.contract.errors import ModelDirError

from infc.compiler.contract.bind import KernelInfo
from infc.compiler.contract.schema import DTYPE_BYTES
from .driver import Module, PackedArgs


class KernelFn(KernelInfo):
    """A loaded kernel: its launch shape (bind.KernelInfo) and function handle."""

    def __init__(self, kid: str, meta: dict, info: dict, fn):
        super().__init__(kid, meta, info)
        self.fn = fn

    def pack(self, values: list, global_scratch: int = 0) -> PackedArgs:
        """The resolved META params (bind.Resolver) packed once, with Triton's hidden pointers
        (global_scratch: the kernel's global scratch address, if it has one)."""
        return PackedArgs(*self.arg_lists(values, global_scratch))


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
