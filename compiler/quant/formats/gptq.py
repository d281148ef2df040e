"""`quant_method: gptq` (AutoGPTQ / GPTQModel / optimum): 4- or 8-bit integer weights in groups
along K, stored transposed ([K, N]) and packed along K:

    "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128,
        "desc_act": false, "sym": true, "checkpoint_format": "gptq"}     (or "format")

    qweight  I32 [K*b/32, N]   word r of column n packs rows r*32/b.., element i at bits b*i
    qzeros   I32 [G, N*b/32]   the zero points, packed along N the same way
    scales   F16 [G, N]
    g_idx    I32 [K]           the group of row k (act-order, desc_act: a permutation's groups)
    W[n, k] = (qweight[k, n] - z[g(k), n]) * scales[g(k), n]

`checkpoint_format: gptq` (v1, what AutoGPTQ and optimum write) stores z - 1 in qzeros; gptq_v2
stores z. A symmetric checkpoint's zero point is 2^(b-1) (its qzeros say so: v1 stores 7 / 127):
it is read as the scheme's implied zero, as vLLM's kernels read it, not from qzeros.
group_size -1 is one group per row. Without desc_act the groups are k // group_size and g_idx
is not read.
"""
from ..config_keys import ConfigKeys, not_converted
from ..format_base import QuantFormat, format_parser, scale_tensor
from ..scheme import QuantScheme

_KEYS = {"quant_method", "bits", "group_size", "desc_act", "sym", "checkpoint_format", "format",
         "modules_to_not_convert", "lm_head", "is_marlin_format", "pack_dtype", "dynamic"}
# what the GPTQ tools record about how they quantized: nothing the stored tensors' meaning depends on
_META = {"damp_percent", "damp_auto_increment", "true_sequential", "static_groups", "model_name_or_path",
         "model_file_base_name", "quantizer", "meta", "act_group_aware", "mse", "v2", "v2_alpha",
         "v2_memory_device", "pack_dtype", "adapter", "rotation", "dataset", "tokenizer", "backend",
         "use_cuda_fp16", "use_exllama", "exllama_config", "max_input_length", "cache_block_outputs",
         "model_seqlen", "block_name_to_quantize", "module_name_preceding_first_block", "batch_size",
         "pad_token_id", "modules_in_block_to_quantize", "hyb_act", "offload_to_disk",
         "offload_to_disk_path", "mock_quantization", "gptaq", "foem", "fail_safe",
         "hessian", "gar"}


def _t(src: dict) -> dict:
    return {"transpose": src}


class Gptq(QuantFormat):
    method = "gptq"

    def __init__(self, bits: int, group: int | None, act_order: bool, sym: bool, v1: bool, skip: list):
        self.bits, self.group, self.act_order, self.sym, self.v1, self.skip = bits, group, act_order, sym, v1, skip
        # g_idx without act-order is k // group_size; a symmetric scheme's zero point is implied
        self.unread = (() if act_order else ("*.g_idx",)) + (("*.qzeros",) if sym else ())

    def scheme_for(self, module):
        if module == "lm_head" or not_converted(module, self.skip):
            return None
        return QuantScheme("u4" if self.bits == 4 else "u8", 1, self.group, zeros=not self.sym,
                           g_idx=self.act_order)

    def sources(self, module, scheme, n, k):
        b = self.bits
        out = {"codes": _t({"unpack": f"{module}.qweight", "bits": b, "axis": 0, "count": k}),
               "w_scale": _t(scale_tensor(f"{module}.scales"))}
        if scheme.zeros:
            z = _t({"unpack": f"{module}.qzeros", "bits": b, "axis": 1, "count": n})
            out["w_zero"] = {"offset": z, "by": 1} if self.v1 else z
        if scheme.g_idx:
            out["w_gidx"] = {"index": f"{module}.g_idx", "groups": scheme.groups(k)}
        return out


def _layout(c: ConfigKeys) -> str:
    """The qzeros layout, 'gptq' (v1) or 'gptq_v2': `checkpoint_format` (transformers' and
    optimum's key) or `format` (GPTQModel's older one); where both are given they must agree."""
    got = {}
    for key in ("checkpoint_format", "format"):
        if c.has(key):
            v = c.get(key)
            if not isinstance(v, str) or v.lower() not in ("gptq", "gptq_v2"):
                raise c.bad(key, f"{v!r}: the GPTQ layouts read are 'gptq' (v1) and 'gptq_v2'")
            got[key] = v.lower()
    if len(set(got.values())) > 1:
        raise c.bad("format", f"{c.d['format']!r} and checkpoint_format {c.d['checkpoint_format']!r} "
                              f"disagree: which layout the qzeros are stored in is unknown")
    return next(iter(got.values()), "gptq")


@format_parser("gptq")
def parse(q: dict, where: str) -> Gptq:
    c = ConfigKeys(q, where).only(_KEYS, _META)
    bits = c.int("bits", choices=(4, 8))
    group = c.int("group_size", 128, positive=False)
    if group == 0 or group < -1:
        raise c.bad("group_size", f"{group}: must be positive, or -1 for one group per row")
    act_order = c.bool("desc_act", False)
    sym = c.bool("sym", True)
    fmt = _layout(c)
    if c.get("is_marlin_format", False) is not False:
        raise c.bad("is_marlin_format", f"{q['is_marlin_format']!r}: Marlin-repacked GPTQ weights are not read")
    c.get("pack_dtype", "int32", choices=("int32",))
    if c.get("lm_head", False) is not False:
        raise c.bad("lm_head", f"{q['lm_head']!r}: a quantized lm_head is not read")
    # GPTQModel's per-module overrides (`+:regex`: other bits / group_size / desc_act / sym,
    # `-:regex`: left unquantized): the stored tensors of those modules mean something else
    if c.get("dynamic", {}) != {}:
        raise c.bad("dynamic", "per-module overrides (GPTQModel's dynamic) are not read: every module "
                               "is read with the top-level bits, group_size, desc_act and sym")
    return Gptq(bits, None if group == -1 else group, act_order, sym, fmt == "gptq",
                c.names("modules_to_not_convert"))
