"""`quant_method: fp8` (Qwen3-*-FP8, DeepSeek-V3): e4m3 weights in weight_block_size blocks with
a float32 `weight_scale_inv` per block (despite its name, the multiplier: W = w * s), and
activations quantized per token in groups of the block's K size, dynamically.

    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
        "activation_scheme": "dynamic", "weight_block_size": [128, 128],
        "modules_to_not_convert": ["lm_head", ...]}          (also "ignored_layers")

A module listed in modules_to_not_convert / ignored_layers (compiler/quant/config_keys.py's
not_converted: a name or regex up to a module boundary, or a suffix) stays bf16.
Without weight_block_size the checkpoint is per-tensor fp8 (`weight_scale_inv` [1]), stored per
row in the canonical form.
"""
from ..config_keys import ConfigKeys, not_converted
from ..format_base import QuantFormat, format_parser
from ..scheme import QuantScheme

_KEYS = {"quant_method", "fmt", "activation_scheme", "weight_block_size", "modules_to_not_convert",
         "ignored_layers", "dequantize"}


class Fp8Block(QuantFormat):
    method = "fp8"

    def __init__(self, block, act: str, skip: list):
        self.block, self.act, self.skip = block, act, skip

    def scheme_for(self, module: str):
        if not_converted(module, self.skip):
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


@format_parser("fp8")
def parse(q: dict, where: str) -> Fp8Block:
    c = ConfigKeys(q, where).only(_KEYS)
    c.get("fmt", "e4m3", choices=("e4m3",))
    act = c.get("activation_scheme", "dynamic", choices=("dynamic", "static"))
    block = c.get("weight_block_size", None)
    if block is not None:
        if not (isinstance(block, list) and len(block) == 2
                and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise c.bad("weight_block_size", f"{block!r}: must be [rows, columns], two positive integers")
        if act == "static":
            raise c.bad("activation_scheme", "'static' with weight_block_size: block-quantized "
                                             "checkpoints quantize activations dynamically")
    if c.get("dequantize", False) is not False:
        raise c.bad("dequantize", "a checkpoint to be dequantized at load is not an fp8 checkpoint to serve")
    return Fp8Block(tuple(block) if block else None, act,
                    c.names("modules_to_not_convert") + c.names("ignored_layers"))
