"""`quant_method: awq` (AutoAWQ, GEMM packing): 4-bit asymmetric weights in groups along K, stored
transposed ([K, N] like the GEMM's B operand):

    "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128,
        "zero_point": true, "version": "gemm", "modules_to_not_convert": null}

    qweight  I32 [K, N/8]    word j of row k packs columns 8j..8j+7, nibble i holding column
                             8j + AWQ_ORDER[i] (runtime/weights/quant_int_recipes.py)
    qzeros   I32 [K/g, N/8]  the zero points, packed the same way
    scales   F16 [K/g, N]
    W[n, k] = (qweight[k, n] - qzeros[k // g, n]) * scales[k // g, n]
"""
from ..config_keys import ConfigKeys, not_converted
from ..format_base import QuantFormat, format_parser, scale_tensor
from ..scheme import QuantScheme

_KEYS = {"quant_method", "bits", "group_size", "zero_point", "version", "modules_to_not_convert"}
_META = {"backend", "do_fuse", "fuse_max_seq_len", "modules_to_fuse", "exllama_config"}


def _t(src: dict) -> dict:
    return {"transpose": src}


class Awq(QuantFormat):
    method = "awq"

    def __init__(self, group: int | None, skip: list):
        self.group, self.skip = group, skip

    def scheme_for(self, module):
        return None if not_converted(module, self.skip) else QuantScheme("u4", 1, self.group, zeros=True)

    def sources(self, module, scheme, n, k):
        return {"codes": _t({"unpack": f"{module}.qweight", "bits": 4, "axis": 1, "count": n, "order": "awq"}),
                "w_zero": _t({"unpack": f"{module}.qzeros", "bits": 4, "axis": 1, "count": n, "order": "awq"}),
                "w_scale": _t(scale_tensor(f"{module}.scales"))}


@format_parser("awq")
def parse(q: dict, where: str) -> Awq:
    c = ConfigKeys(q, where).only(_KEYS, _META)
    c.int("bits", 4, choices=(4,))
    version = c.get("version", "gemm")
    if not isinstance(version, str) or version.lower() != "gemm":
        raise c.bad("version", f"{version!r}: only AutoAWQ's GEMM packing is read ('gemm'); GEMV and "
                               f"exllama layouts pack differently")
    if not c.bool("zero_point", True):
        raise c.bad("zero_point", "false: AWQ checkpoints are read with zero points (true)")
    group = c.int("group_size", 128, positive=False)
    if group == 0 or group < -1:
        raise c.bad("group_size", f"{group}: must be positive, or -1 for one group per row")
    return Awq(None if group == -1 else group, c.names("modules_to_not_convert"))
