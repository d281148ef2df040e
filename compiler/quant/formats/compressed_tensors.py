"""`quant_method: compressed-tensors` (llm-compressor): schemes per `config_groups`, each applying
to the modules its `targets` name (`Linear`: every linear; `re:` a regex matched from the start;
else a module name), minus the `ignore` list.

    "config_groups": {"group_0": {"targets": ["Linear"], "format": "pack-quantized",
        "weights": {"num_bits": 4, "type": "int", "symmetric": true, "strategy": "group",
                    "group_size": 128, "dynamic": false, "actorder": null},
        "input_activations": null}},
    "format": "pack-quantized", "ignore": ["lm_head"], "quantization_status": "compressed"

Stored tensors, per format (compressed-tensors' compressors):
    float-quantized   `weight` F8_E4M3 [N, K], `weight_scale` ([1] tensor, [N, 1] channel,
                      [N, K/g] group, [N/bn, K/bk] block), static activations: `input_scale` [1]
    pack-quantized    `weight_packed` I32 [N, ceil(K*b/32)]: signed b-bit values plus 2^(b-1),
                      element i at bits b*i of the row's little-endian bit stream;
                      `weight_scale` as above; asymmetric: `weight_zero_point` packed the same way
                      along N ([ceil(N*b/32), groups]); act-order "group": `weight_g_idx` [K]
    naive-quantized   `weight` I8 [N, K] (signed), `weight_zero_point` I8 (asymmetric)
The signed values' 2^(b-1) offset makes them the canonical unsigned codes; a symmetric scheme's
implied zero point is that offset (compiler/quant/scheme.py).
"""
import re

from ...contract.errors import ModelDirError
from ..config_keys import ConfigKeys
from ..format_base import QuantFormat, format_parser, scale_tensor
from ..scheme import QuantScheme

_TOP = {"quant_method", "config_groups", "format", "ignore", "quantization_status", "kv_cache_scheme",
        "sparsity_config", "transform_config", "global_compression_ratio", "version"}
_GROUP = {"targets", "weights", "input_activations", "output_activations", "format"}
_ARGS = {"num_bits", "type", "symmetric", "group_size", "strategy", "block_structure", "dynamic",
         "actorder", "observer", "observer_kwargs", "scale_dtype", "zp_dtype"}
_FORMATS = ("float-quantized", "pack-quantized", "naive-quantized", "int-quantized")


class _Group:
    def __init__(self, targets, scheme: QuantScheme, fmt: str, strategy: str, name: str = ""):
        self.targets, self.scheme, self.fmt, self.strategy, self.name = targets, scheme, fmt, strategy, name


def _matches(module: str, target: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target == "Linear" or target == module


def _specificity(target: str) -> tuple:
    """How compressed-tensors (match_targets) ranks the targets a module matches, the first
    winning: a module name, then a regex (both by their text), then the class `Linear`; so a
    group naming `re:.*down_proj` takes down_proj from a group of every `Linear`, wherever the
    two stand in config_groups. Of groups naming the same target the last wins (its
    target -> scheme map)."""
    return (target == "Linear", target.startswith("re:"), target)


class CompressedTensors(QuantFormat):
    method = "compressed-tensors"
    keeps_output_head = False                # its ignore list decides (llm-compressor lists lm_head)
    unread = ("*.weight_shape",)          # the dense shape, which the plan already knows

    def __init__(self, groups: list, ignore: list):
        self.groups, self.ignore = groups, ignore

    def _group(self, module: str):
        if any(_matches(module, t) and t != "Linear" for t in self.ignore):
            return None
        matched = [(_specificity(t), -i) for i, g in enumerate(self.groups) for t in g.targets
                   if _matches(module, t)]
        return self.groups[-min(matched)[1]] if matched else None

    def scheme_for(self, module):
        g = self._group(module)
        return None if g is None else g.scheme

    def scheme_name(self, module, scheme):
        g = self._group(module)
        return f"quantization_config.config_groups.{g.name}'s scheme ({scheme}, {g.fmt})"

    def unquantized_why(self, module):
        hit = next((t for t in self.ignore if _matches(module, t) and t != "Linear"), None)
        if hit is not None:
            return f"quantization_config.ignore lists it ({hit!r})"
        targets = "; ".join(f"{g.name}: {g.targets}" for g in self.groups)
        return (f"no target of quantization_config.config_groups matches it: {targets}; compressed-tensors "
                f"skips a target that matches no module, with a warning")

    def act_group_error(self, scheme, why):
        g = next((g for g in self.groups if g.scheme == scheme), None)
        if g is None:
            return super().act_group_error(scheme, why)
        return ModelDirError(f"{self.where}: quantization_config.config_groups.{g.name}.input_activations."
                             f"group_size: {scheme.act_group}: {why}")

    def sources(self, module, scheme, n, k):
        g = self._group(module)
        bits = scheme.bits
        if g.fmt == "float-quantized":
            codes = {"fp8": f"{module}.weight"}
        elif g.fmt == "pack-quantized":
            codes = {"unpack": f"{module}.weight_packed", "bits": bits, "axis": 1, "count": k}
        else:
            codes = {"signed": f"{module}.weight", "bits": bits}
        scale = scale_tensor(f"{module}.weight_scale")
        out = {"codes": codes, "w_scale": {"rows": scale, "count": n} if g.strategy == "tensor" else scale}
        if scheme.zeros:
            zp = f"{module}.weight_zero_point"
            out["w_zero"] = {"unpack": zp, "bits": bits, "axis": 0, "count": n} \
                if g.fmt == "pack-quantized" else {"signed": zp, "bits": bits}
        if scheme.g_idx:
            out["w_gidx"] = {"index": f"{module}.weight_g_idx", "groups": scheme.groups(k)}
        if scheme.act == "static":
            out["x_scale"] = scale_tensor(f"{module}.input_scale")
        return out



def _weights(w: ConfigKeys, fmt: str, fmt_key: str, top: ConfigKeys):
    """(codes, block_n, block_k, zeros, g_idx, strategy) of a group's `weights`."""
    w.only(_ARGS)
    kind = w.get("type", "int", choices=("int", "float"))
    bits = w.int("num_bits", 8)
    if kind == "float":
        if bits != 8:
            raise w.bad("num_bits", f"{bits}: float weights are read as fp8 (e4m3) only")
        if fmt != "float-quantized":
            raise top.bad(fmt_key, f"{fmt!r}: fp8 weights are stored 'float-quantized'")
    else:
        if bits not in (4, 8):
            raise w.bad("num_bits", f"{bits}: integer weights are read with 4 or 8 bits")
        if fmt == "float-quantized":
            raise top.bad(fmt_key, f"{fmt!r}: integer weights are stored 'pack-quantized' or 'naive-quantized'")
    if w.get("dynamic", False) is not False:
        raise w.bad("dynamic", f"{w.d['dynamic']!r}: weights are quantized in the checkpoint (false)")
    sym = w.bool("symmetric", True)
    if kind == "float" and not sym:
        raise w.bad("symmetric", "false: fp8 weights have no zero point")
    strategy = w.get("strategy", "tensor", choices=("tensor", "channel", "group", "block"))
    group = w.int("group_size", None)
    if (strategy == "group") != (group is not None):
        raise w.bad("group_size", f"{group!r} with strategy {strategy!r}: a group size is given exactly "
                                  f"for strategy 'group'")
    block = w.block("block_structure")
    if (strategy == "block") != (block is not None):
        raise w.bad("block_structure", f"{list(block) if block else None!r} with strategy {strategy!r}: a "
                                       f"block structure is given exactly for strategy 'block'")
    if not sym and strategy not in ("channel", "group"):
        raise w.bad("symmetric", f"false with strategy {strategy!r}: zero points are read per channel "
                                 f"or per group")
    # "group" (and its older spellings true / "dynamic") stores weight_g_idx; "weight" / "static"
    # only reordered calibration
    actorder = w.get("actorder", None)
    if actorder not in (None, False, True, "weight", "static", "group", "dynamic"):
        raise w.bad("actorder", f"{actorder!r}: must be 'group', 'weight', 'static' or null")
    g_idx = actorder in (True, "group", "dynamic")
    if g_idx and strategy != "group":
        raise w.bad("actorder", f"{actorder!r} with strategy {strategy!r}: act-order groups need "
                                f"strategy 'group'")
    codes = "f8e4m3" if kind == "float" else ("u4" if bits == 4 else "u8")
    bn, bk = (block[0], block[1]) if block else (1, group)
    return codes, bn, bk, not sym, g_idx, strategy


def _activations(a: ConfigKeys | None, codes: str):
    """(act, act_group) of a group's `input_activations`."""
    if a is None:
        return "none", None
    a.only(_ARGS)
    if a.get("type", "int") != "float" or a.int("num_bits", 8) != 8:
        raise a.bad("type", f"{a.d.get('type', 'int')!r} {a.d.get('num_bits', 8)}-bit activations: "
                            f"activations are read quantized as fp8 only (type float, num_bits 8)")
    if codes != "f8e4m3":
        raise a.bad("type", "fp8 activations with integer weights: not a scheme infc computes")
    if not a.bool("symmetric", True):
        raise a.bad("symmetric", "false: fp8 activations have no zero point")
    dynamic = a.get("dynamic", False)
    strategy = a.get("strategy", "tensor", choices=("tensor", "token", "group"))
    if dynamic is False:
        if strategy != "tensor":
            raise a.bad("strategy", f"{strategy!r} with dynamic false: static activation scales are "
                                    f"per tensor")
        return "static", None
    if dynamic is not True:
        raise a.bad("dynamic", f"{dynamic!r}: must be true or false")
    if strategy == "token":
        return "dynamic_token", None
    if strategy == "group":
        return "dynamic_group", a.int("group_size")
    raise a.bad("strategy", "'tensor' with dynamic true: a dynamic per-tensor scale is not computed "
                            "(use 'token')")


@format_parser("compressed-tensors")
def parse(q: dict, where: str) -> CompressedTensors:
    top = ConfigKeys(q, where).only(_TOP)
    status = top.get("quantization_status", "compressed")
    if status != "compressed":
        raise top.bad("quantization_status", f"{status!r}: infc reads checkpoints saved 'compressed'")
    # an object or null: --kv-cache-dtype fp8 reads the KV scales from the tensors (compiler/kv_scales.py)
    top.sub("kv_cache_scheme", None)
    for key in ("sparsity_config", "transform_config"):
        if top.d.get(key):
            raise top.bad(key, "sparse or transformed checkpoints are not read")
    default_fmt = top.get("format", None)
    ignore = top.names("ignore")
    groups_cfg = top.sub("config_groups")
    if not groups_cfg.d:
        raise top.bad("config_groups", "empty: no scheme to read")
    groups = []
    for gname in groups_cfg.d:
        g = groups_cfg.sub(gname).only(_GROUP)
        targets = g.names("targets")
        if not targets:
            raise g.bad("targets", "missing or empty: which modules the scheme quantizes")
        if g.d.get("output_activations") is not None:
            raise g.bad("output_activations", "quantized outputs are not read")
        fmt_keys, fmt = (g, "format") if g.has("format") else (top, "format")
        fmt_name = fmt_keys.get(fmt, default_fmt)
        if fmt_name not in _FORMATS:
            raise fmt_keys.bad(fmt, f"{fmt_name!r}: must be one of {', '.join(_FORMATS)}")
        codes, bn, bk, zeros, g_idx, strategy = _weights(g.sub("weights"), fmt_name, fmt, fmt_keys)
        act, act_group = _activations(g.sub("input_activations", None), codes)
        scheme = QuantScheme(codes, bn, bk, zeros=zeros, g_idx=g_idx, act=act, act_group=act_group)
        groups.append(_Group(targets, scheme, fmt_name, strategy, gname))
    return CompressedTensors(groups, ignore)
