"""`quant_method: fp8` (Qwen3-*-FP8, DeepSeek-V3, DeepSeek-V4): e4m3 weights in weight_block_size
blocks with a scale per block (`weight_scale_inv`, despite its name the multiplier: W = w * s),
and activations quantized per token in groups of the block's K size, dynamically.

    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
        "activation_scheme": "dynamic", "weight_block_size": [128, 128],
        "scale_fmt": "ue8m0", "expert_dtype": "fp4",
        "modules_to_not_convert": ["lm_head", ...]}          (also "ignored_layers")

scale_fmt "float" (the default) stores scales as float32; "ue8m0" as e8m0 bytes (F8_E8M0:
2^(byte - 127), powers of two). expert_dtype "fp8" (the default) stores the routed MoE experts as
every other linear; "fp4" stores each expert's projection as e2m1 codes, two a byte along K with
the even element in the low nibble (I8 [N, K/2]), and one scale per row and 32 columns
([N, K/32], in scale_fmt): OCP MXFP4's math (compiler/quant/formats/mxfp4.py) in a flat layout,
read onto the same e2m1 scheme, weight-only. DeepSeek-V4's config.json ships expert_dtype at its
top level; parse_quantization folds it in (as transformers' DeepseekV4Config does).

The scale tensor is `<module>.weight_scale_inv` (transformers' name) or `<module>.scale` (the
DeepSeek-V4 checkpoint's own): whichever the checkpoint holds (see_checkpoint), else the former.
A module listed in modules_to_not_convert / ignored_layers (compiler/quant/config_keys.py's
not_converted: a name or regex up to a module boundary, or a suffix) stays bf16, and so does one
whose weight the checkpoint stores as a plain float tensor with no scale beside it: DeepSeek-V4
keeps its compressor and indexer projections bf16 without listing them (transformers knows them
from its model class; infc reads them from the checkpoint, which says it of itself).
Without weight_block_size the checkpoint is per-tensor fp8 (`weight_scale_inv` [1]), stored per
row in the canonical form.
"""
from ...contract.errors import ModelDirError
from ..config_keys import ConfigKeys, not_converted
from ..format_base import QuantFormat, any_layer, format_parser, scale_tensor
from ..scheme import MX_BLOCK, QuantScheme

_KEYS = {"quant_method", "fmt", "activation_scheme", "weight_block_size", "modules_to_not_convert",
         "ignored_layers", "dequantize", "scale_fmt", "expert_dtype"}
SCALE_FMTS = ("float", "ue8m0")
EXPERT_DTYPES = ("fp8", "fp4")
SCALE_NAMES = ("weight_scale_inv", "scale")          # transformers' spelling first
_PLAIN = ("BF16", "F16", "F32")                     # a weight stored unquantized


class Fp8Block(QuantFormat):
    method = "fp8"

    def __init__(self, block, act: str, skip: list, scale_fmt: str = "float", expert_dtype: str = "fp8"):
        self.block, self.act, self.skip = block, act, skip
        self.scale_fmt, self.expert_dtype = scale_fmt, expert_dtype

    def _plain_in_checkpoint(self, module: str) -> bool:
        """The checkpoint stores the module's weight unquantized: a float tensor, no scale beside
        it (a float weight WITH a scale is left to checkpoint honesty, which names its dtype)."""
        if self.stored is None or self.stored.get(f"{module}.weight") not in _PLAIN:
            return False
        return not any(f"{module}.{s}" in self.stored for s in SCALE_NAMES)

    def scheme_for(self, module: str):
        if not_converted(module, self.skip) or self._plain_in_checkpoint(module):
            return None
        if self.block is None:
            return QuantScheme("f8e4m3", 1, None, act="dynamic_token" if self.act == "dynamic" else "static")
        bn, bk = self.block
        return QuantScheme("f8e4m3", bn, bk, act="dynamic_group" if self.act == "dynamic" else "static",
                           act_group=bk if self.act == "dynamic" else None)

    def act_group_error(self, scheme, why):
        if self.block is None:
            return super().act_group_error(scheme, why)
        return ModelDirError(f"{self.where}: quantization_config.weight_block_size {list(self.block)}: its "
                             f"columns are the activations' quantization group, and {why}; e.g. [128, 128], "
                             f"as published (the rows may be any number)")

    def expert_scheme_for(self, module: str):
        if self.expert_dtype == "fp8" or not_converted(module, self.skip) or self._plain_in_checkpoint(module):
            return self.scheme_for(module)
        return QuantScheme("e2m1", 1, MX_BLOCK)

    def _scale_name(self, module: str) -> str:
        """module: a name pattern ({i}, {e}); the spelling of any layer's and expert's."""
        for s in reversed(SCALE_NAMES):              # the checkpoint's own spelling where it has it
            if any_layer(f"{module}.{s}") in self.stored_patterns():
                return f"{module}.{s}"
        return f"{module}.{SCALE_NAMES[0]}"

    def _scale(self, module: str) -> dict:
        name = self._scale_name(module)
        return {"e8m0": name} if self.scale_fmt == "ue8m0" else scale_tensor(name)

    def sources(self, module, scheme, n, k):
        if scheme.codes == "e2m1":
            return {"codes": {"fp4": f"{module}.weight"}, "w_scale": self._scale(module)}
        scale = self._scale(module)
        out = {"codes": {"fp8": f"{module}.weight"},
               "w_scale": scale if self.block else {"rows": scale, "count": n}}
        if scheme.act == "static":
            out["x_scale"] = scale_tensor(f"{module}.input_scale")
        return out


@format_parser("fp8")
def parse(q: dict, where: str) -> Fp8Block:
    c = ConfigKeys(q, where).only(_KEYS)
    # torch's dtype name for the same OCP e4m3 (finite, NaN only): MiniMax-M2's config.json spells it so
    c.get("fmt", "e4m3", choices=("e4m3", "float8_e4m3fn"))
    act = c.get("activation_scheme", "dynamic", choices=("dynamic", "static"))
    block = c.block("weight_block_size")
    scale_fmt = c.get("scale_fmt", "float", choices=SCALE_FMTS)
    expert_dtype = c.get("expert_dtype", "fp8", choices=EXPERT_DTYPES)
    if block is not None:
        if act == "static":
            raise c.bad("activation_scheme", "'static' with weight_block_size: block-quantized "
                                             "checkpoints quantize activations dynamically")
    elif scale_fmt == "ue8m0":
        raise c.bad("scale_fmt", "'ue8m0' without weight_block_size: e8m0 scales are block scales")
    if expert_dtype == "fp4" and act == "static":
        raise c.bad("expert_dtype", "'fp4' with activation_scheme 'static': fp4 experts carry no "
                                    "activation scale")
    if c.get("dequantize", False) is not False:
        raise c.bad("dequantize", "a checkpoint to be dequantized at load is not an fp8 checkpoint to serve")
    return Fp8Block(block, act,
                    c.names("modules_to_not_convert") + c.names("ignored_layers"), scale_fmt, expert_dtype)
