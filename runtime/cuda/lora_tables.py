"""The device side of the LoRA tables' writer (runtime/lora/tables.py `put`): a slot's rows of a
table weight, rounded to its dtype (bf16 as the loader rounds; the scales f32), copied on the
runner's stream, so the copy lands after the steps already issued and before the next one.

Loading an adapter is rare and small (A and B of rank r per linear): each copy is waited for
before its host array is dropped, rather than kept alive until some later sync."""
import numpy as np

from infc.compiler.contract.safetensors_io import f32_to_bf16_bits
from infc.compiler.contract.schema import DTYPE_BYTES


def device_put(ctx, plan: dict, weights):
    """put(name, layer, slot, index, value) over DeviceWeights `weights` (index: () only)."""
    def put(name: str, layer, slot: int, index: tuple, value):
        w = plan["weights"][name]
        if index != ():
            raise ValueError("the device tables take whole slots")
        per_slot = int(np.prod(w["shape"][1:]))
        value = np.asarray(value, np.float32).reshape(-1)
        if value.size != per_slot:
            raise ValueError(f"LoRA table '{name}': a slot holds {per_slot} values, got {value.size}")
        if w["dtype"] == "bf16":
            host = f32_to_bf16_bits(value)
        elif w["dtype"] == "f32":
            host = value
        else:
            raise ValueError(f"LoRA table '{name}' is {w['dtype']}: the tables are bf16 or f32")
        ctx.htod(weights.ptr(name, layer) + slot * per_slot * DTYPE_BYTES[w["dtype"]], host)
        ctx.sync()
    return put
