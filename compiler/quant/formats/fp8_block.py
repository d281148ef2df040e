"""`quant_method: fp8` (Qwen3-*-FP8, DeepSeek-V3): e4m3 weights in weight_block_size blocks with
a float32 `weight_scale_inv` per block (despite its name, the multiplier: W = w * s), and
activations quantized per token in groups of the block's K size, dynamically.

    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
        "activation_scheme": "dynamic", "weight_block_size": [128, 128],
        "modules_to_not_convert": ["lm_head", ...]}          (also "ignored_layers")

A module listed in modules_to_not_convert (by name, or a name ending with an entry) stays bf16;
so do modules whose checkpoint has no weight_scale_inv (the caller checks the checkpoint).
Without weight_block_size the checkpoint is per-tensor fp8 (`weight_scale_inv` [1]), stored per
row in the canonical form.
"""
from ...contract.errors import ModelDirError
from ..scheme import QuantScheme
from ..format_base import QuantFormat, format_parser

_KEYS = {"quant_method", "fmt", "activation_scheme", "weight_block_size", "modules_to_not_convert",
         "ignored_layers", "dequantize"}


class Fp8Block(QuantFormat):
    method = "fp8"

    def __init__(self, block, act: str, skip: list):
        self.block, self.act, self.skip = block, act, skip

    def scheme_for(self, module: str):
        if any(module == s or module.endswith("." + s) or module.startswith(s + ".") for s in self.skip):
            return None
        if self.block is None:
            return QuantScheme("f8e4m3", 1, None, act="dynamic_token" if self.act == "dynamic" else "static")
        bn, bk = self.block
        return QuantScheme("f8e4m3", bn, bk, act="dynamic_group" if self.act == "dynamic" else "static",
                           act_group=bk if self.act == "dynamic" else None)

    def sources(self, module, scheme, n, k):
        scale = {"tensor": f"{module}.weight_scale_inv"}
        out = {"codes": {"fp8": f"{module}.weight"},
               "w_scale": scale if self.block else {"rows": scale, "count": n}}
        if scheme.act == "static":
            out["x_scale"] = {"tensor": f"{module}.input_scale"}
        return out

    def tensors(self, module, scheme):
        out = {f"{module}.weight": ("F8_E4M3",), f"{module}.weight_scale_inv": ("F32", "BF16")}
        if scheme.act == "static":
            out[f"{module}.input_scale"] = ("F32", "BF16")
        return out


@format_parser("fp8")
def parse(q: dict, where: str) -> Fp8Block:
    def bad(key, why):
        return ModelDirError(f"{where}: quantization_config.{key}: {why}")
    for key in q:
        if key not in _KEYS:
            raise bad(key, f"unknown key for quant_method fp8 (known: {', '.join(sorted(_KEYS))})")
    if q.get("fmt", "e4m3") != "e4m3":
        raise bad("fmt", f"{q['fmt']!r}: only e4m3 is read")
    act = q.get("activation_scheme", "dynamic")
    if act not in ("dynamic", "static"):
        raise bad("activation_scheme", f"{act!r}: must be 'dynamic' or 'static'")
    block = q.get("weight_block_size")
    if block is not None:
        if not (isinstance(block, list) and len(block) == 2
                and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise bad("weight_block_size", f"{block!r}: must be [rows, columns], two positive integers")
        if act == "static":
            raise bad("activation_scheme", "'static' with weight_block_size: block-quantized "
                                           "checkpoints quantize activations dynamically")
    if q.get("dequantize") not in (None, False):
        raise bad("dequantize", "a checkpoint to be dequantized at load is not an fp8 checkpoint to serve")
    skip = []
    for key in ("modules_to_not_convert", "ignored_layers"):
        v = q.get(key) or []
        if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
            raise bad(key, f"{v!r}: must be a list of module names")
        skip += v
    return Fp8Block(tuple(block) if block else None, act, skip)
