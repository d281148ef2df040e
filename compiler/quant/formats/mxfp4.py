"""`quant_method: mxfp4` (GPT-OSS): OCP MXFP4 weights, e2m1 codes in blocks of 32 along K with one
e8m0 scale a block; activations stay bf16.

    "quantization_config": {"quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"]}

A parameter `P` [N, K] is stored as `P_blocks` U8 [N, K/32, 16] (two codes a byte, the even
element in the low nibble) and `P_scales` U8 [N, K/32] (e8m0: 2^(s - 127)); for a linear module
M that is `M.weight_blocks` / `M.weight_scales`, and so for each expert's projection
(`...experts.{e}.gate_proj.weight_blocks`), which quantize_weights stacks per expert. GPT-OSS's
own checkpoints fuse the experts into one parameter P per projection (`mlp.experts.gate_up_proj`,
gate|up interleaved row by row; `down_proj`): `P_blocks` U8 [E, N, K/32, 16] and `P_scales`
U8 [E, N, K/32], each expert [N, K] (transformers dequantizes and transposes them into its
[E, K, N] parameter): param_sources.
"""
from ..config_keys import ConfigKeys, not_converted
from ..format_base import QuantFormat, format_parser
from ..scheme import MX_BLOCK, QuantScheme

_KEYS = {"quant_method", "modules_to_not_convert", "dequantize"}


class Mxfp4(QuantFormat):
    method = "mxfp4"

    def __init__(self, skip: list):
        self.skip = skip

    def scheme_for(self, module):
        return None if not_converted(module, self.skip) else QuantScheme("e2m1", 1, MX_BLOCK)

    def sources(self, module, scheme, n, k):
        return {"codes": {"mxfp4": f"{module}.weight_blocks"}, "w_scale": {"e8m0": f"{module}.weight_scales"}}

    def param_sources(self, param, scheme):
        return {"codes": {"mxfp4": f"{param}_blocks"}, "w_scale": {"e8m0": f"{param}_scales"}}


@format_parser("mxfp4")
def parse(q: dict, where: str) -> Mxfp4:
    c = ConfigKeys(q, where).only(_KEYS)
    if c.get("dequantize", False) is not False:
        raise c.bad("dequantize", f"{q['dequantize']!r}: a checkpoint to be dequantized at load is not "
                                  f"an mxfp4 checkpoint to serve")
    return Mxfp4(c.names("modules_to_not_convert"))
