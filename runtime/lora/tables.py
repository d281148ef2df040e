"""An adapter written into (or cleared from) one slot of a plan's LoRA tables
(compiler/passes/add_lora.py lays them out: plan["lora"]).

`check` runs before any write and raises naming the module and tensor that does not fit, so a
bad adapter leaves every slot as it was. The write goes through `put(weight, layer, slot, index,
array)`, so the numpy weights of the CPU backend and the device tables of the CUDA runner
(runtime/cuda) fill their slots the same way.
"""
import numpy as np

from infc.compiler.contract.errors import ModelDirError

from ..weights.load import at
from .adapter import Adapter


F32_MAX = float(np.finfo(np.float32).max)


class AdapterError(ModelDirError, ValueError):
    """An adapter that does not fit the plan: its path and what is wrong (a ValueError: a bad
    request's, where a server loads it)."""


class AdapterNotLoaded(AdapterError):
    """A request's adapter is not loaded (any more): unloaded after the server took the request,
    before it ran. The model the request names is gone, as if it had never been loaded (the
    server's 404), which is not the engine failing the request (its 500)."""

    def __init__(self, name: str, message: str):
        super().__init__(message)
        self.name = name


def module_map(plan: dict) -> dict[str, tuple]:
    """concrete module name -> (A table, piece index, layer, K, N of the piece)."""
    out = {}
    for a_name, t in plan["lora"]["linears"].items():
        for layer in t["layers"] or [None]:
            for p, piece in enumerate(t["pieces"]):
                if piece["module"] is not None:
                    m = piece["module"] if layer is None else piece["module"].replace("{i}", str(layer))
                    out[m] = (a_name, p, layer, t["k"], piece["n"])
    return out


def check(plan: dict, adapter: Adapter, modules: dict | None = None):
    """Every module of the adapter is one the plan adapts, with A [r, K] and B [N, r] of its
    shapes and r within the plan's max rank."""
    modules = module_map(plan) if modules is None else modules
    R = plan["lora"]["max_rank"]
    where = f"LoRA adapter '{adapter.name}' ({adapter.path})"
    if not adapter.modules:
        raise AdapterError(f"{where}: no LoRA weights (lora_A / lora_B tensors)")
    for m, d in sorted(adapter.modules.items()):
        if m not in modules:
            targets = ", ".join(plan["lora"]["targets"])
            raise AdapterError(f"{where}: module '{m}' is not one this build adapts (targets: {targets}; "
                               f"rebuild with --lora-target-modules naming it)")
        _, _, _, K, N = modules[m]
        if d.a.ndim != 2 or d.b.ndim != 2 or d.a.shape[0] != d.b.shape[1]:
            raise AdapterError(f"{where}: '{m}.lora_A.weight' {list(d.a.shape)} and '{m}.lora_B.weight' "
                               f"{list(d.b.shape)} are not [r, K] and [N, r] of one rank")
        if d.rank > R:
            raise AdapterError(f"{where}: '{m}' has rank {d.rank}, above --max-lora-rank {R}")
        if d.a.shape[1] != K:
            raise AdapterError(f"{where}: '{m}.lora_A.weight' is {list(d.a.shape)}, the model's module "
                               f"takes K = {K} inputs: [{d.rank}, {K}] expected")
        if d.b.shape[0] != N:
            raise AdapterError(f"{where}: '{m}.lora_B.weight' is {list(d.b.shape)}, the model's module "
                               f"has N = {N} outputs: [{N}, {d.rank}] expected")
        # the scale table is float32: a scale past its range (alpha 1e300) would be inf there
        if not abs(d.scale) <= F32_MAX or not (np.isfinite(d.a).all() and np.isfinite(d.b).all()):
            raise AdapterError(f"{where}: '{m}' has a non-finite scale or weight (scale {d.scale:g})")


def numpy_put(plan: dict, weights: dict):
    """put() over numpy tables (the CPU backend's weights)."""
    def put(name: str, layer, slot: int, index: tuple, value):
        at(plan, weights, name, layer)[(slot,) + index] = value
    return put


def write(plan: dict, put, slot: int, adapter: Adapter | None, clear: bool = False):
    """Slot `slot` (1..max_loras) of every table holds `adapter` (None: zeros); check() first.
    clear=True also takes slot 0 (zeros only): tables a dummy loader filled at random."""
    lora = plan["lora"]
    R = lora["max_rank"]
    if not (clear and slot == 0 and adapter is None) and not 1 <= slot <= lora["max_loras"]:
        raise ValueError(f"LoRA slot {slot} is not in 1..{lora['max_loras']} (slot 0 is no adapter)")
    for a_name, t in lora["linears"].items():
        for layer in t["layers"] or [None]:
            n_total = sum(p["n"] for p in t["pieces"])
            A = np.zeros((len(t["pieces"]) * R, t["k"]), np.float32)
            B = np.zeros((n_total, R), np.float32)
            S = np.zeros(len(t["pieces"]), np.float32)
            n0 = 0
            for p, piece in enumerate(t["pieces"]):
                m = piece["module"]
                d = None if adapter is None or m is None else \
                    adapter.modules.get(m if layer is None else m.replace("{i}", str(layer)))
                if d is not None:
                    A[p * R:p * R + d.rank] = d.a
                    B[n0:n0 + piece["n"], :d.rank] = d.b
                    S[p] = d.scale
                n0 += piece["n"]
            put(a_name, layer, slot, (), A)
            put(t["b"], layer, slot, (), B)
            put(t["scale"], layer, slot, (), S)
