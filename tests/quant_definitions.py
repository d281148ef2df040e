"""The published quantization formats' definitions, computed from a checkpoint's stored tensors
independently of infc (torch, or the format's own library where it installs: compressed-tensors'
decompressor, transformers' MXFP4 converter): what the CPU tests (tests/test_quant_formats.py,
tests/test_quant_moe.py) and the GPU golden gate's HF model (tests/gpu/hf_quant.py) hold infc to.

    WEIGHT[writer](tensors, module, quantization_config) -> the module's weight, float32 [N, K]
    _acts(writer, options, quantization_config, tensors, module) -> its input quantizer, or None
    writer_of(quantization_config) -> (writer, options): the tools/quantize_model.py format that
    names the config's scheme, for a checkpoint read from its config.json alone
"""
import torch


def _bits(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> the b-bit fields they hold along dim, field i of a word at bits b*i."""
    mask, per = (1 << bits) - 1, 32 // bits
    fields = [(words >> (bits * i)) & mask for i in range(per)]
    return torch.stack(fields, dim + 1).flatten(dim, dim + 1)


def _fp8_weight(t, m, cfg):
    w = t[f"{m}.weight"].float()
    s = t[f"{m}.weight_scale_inv"].float()
    if s.numel() == 1:
        return w * s.reshape(())
    bn, bk = cfg["weight_block_size"]
    return w * s.repeat_interleave(bn, 0)[:w.shape[0]].repeat_interleave(bk, 1)[:, :w.shape[1]]


def _ct_weight(t, m, cfg):
    """compressed-tensors' own decompressor on the module's stored tensors (act-order "group",
    which compressed-tensors 0.20 no longer reads but published checkpoints hold: by the
    definition here, as vLLM reads it: column k in group weight_g_idx[k])."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme
    group = cfg["config_groups"]["group_0"]
    state = {k[len(m) + 1:]: v for k, v in t.items() if k.startswith(m + ".")}
    if group["weights"].get("actorder") == "group":    # published before compressed-tensors dropped it
        bits, n = group["weights"]["num_bits"], state["weight_shape"][0]
        q = _bits(state["weight_packed"], bits, 1)[:, :state["weight_shape"][1]].float()
        g = state["weight_g_idx"].long()
        return (q - (1 << (bits - 1))) * state["weight_scale"].float()[:, g][:n]
    scheme = QuantizationScheme(**{k: v for k, v in group.items() if k != "format"})
    if "weight_shape" not in state:
        state["weight_shape"] = torch.tensor(state["weight"].shape)
    return BaseCompressor.load_from_registry(group["format"]).decompress(state, scheme)["weight"].float()


def _awq_weight(t, m, cfg):
    g = cfg["group_size"]
    # AutoAWQ's unpack: the 8 nibbles of a word in order, then its reverse order [0, 4, 1, 5, 2, 6, 3, 7]
    rev = torch.arange(t[f"{m}.scales"].shape[1]).view(-1, 8)[:, [0, 4, 1, 5, 2, 6, 3, 7]].flatten()
    q = _bits(t[f"{m}.qweight"], 4, 1)[:, rev].float()
    z = _bits(t[f"{m}.qzeros"], 4, 1)[:, rev].float()
    s = t[f"{m}.scales"].float()
    return ((q - z.repeat_interleave(g, 0)) * s.repeat_interleave(g, 0)).T


def _gptq_weight(t, m, cfg):
    bits = cfg["bits"]
    q = _bits(t[f"{m}.qweight"], bits, 0).float()                     # [K, N]
    z = _bits(t[f"{m}.qzeros"], bits, 1).float()[:, :q.shape[1]]     # [G, N]
    if cfg["checkpoint_format"] == "gptq":
        z = z + 1
    g = t[f"{m}.g_idx"].long()
    if cfg["group_size"] != -1 and not cfg["desc_act"]:
        g = torch.arange(q.shape[0]) // cfg["group_size"]
    return ((q - z[g]) * t[f"{m}.scales"].float()[g]).T


def _mxfp4_weight(t, m, cfg):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    w = convert_moe_packed_tensors(t[f"{m}.weight_blocks"][None], t[f"{m}.weight_scales"][None],
                                   dtype=torch.float32)
    return w[0].T


_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def _e8m0(s: torch.Tensor) -> torch.Tensor:
    """e8m0 bytes (float8_e8m0fnu or uint8) as float32 powers of two: 2^(byte - 127)."""
    b = s.view(torch.uint8) if s.dtype != torch.uint8 else s
    return torch.exp2(b.float() - 127)


def _fp8_fp4_weight(t, m, cfg):
    """quant_method fp8 with scale_fmt / expert_dtype (DeepSeek-V4): e4m3 codes times their
    block's scale, or for an int8 weight (fp4 experts) the e2m1 values of its nibbles (low one
    first) times the scale of their row and 32 columns; the scale under either spelling."""
    s = t[f"{m}.scale"] if f"{m}.scale" in t else t[f"{m}.weight_scale_inv"]
    s = _e8m0(s) if cfg.get("scale_fmt") == "ue8m0" else s.float()
    w = t[f"{m}.weight"]
    if w.dtype == torch.int8:
        b = w.view(torch.uint8).long()
        codes = torch.stack([b & 15, b >> 4], -1).flatten(-2)
        return torch.tensor(_E2M1)[codes] * s.repeat_interleave(32, -1)
    bn, bk = cfg["weight_block_size"]
    w = w.float()
    return w * s.repeat_interleave(bn, 0)[:w.shape[0]].repeat_interleave(bk, 1)[:, :w.shape[1]]


def _e4m3(x: torch.Tensor, s) -> torch.Tensor:
    return (x / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s


def _acts(writer, o, cfg, t, m):
    """The activation quantizer the format applies to the module's input (None: weight-only)."""
    if writer in ("fp8-block", "fp8-fp4") or o.get("act") == "group":
        bk = cfg["weight_block_size"][1] if writer in ("fp8-block", "fp8-fp4") else \
            cfg["config_groups"]["group_0"]["input_activations"]["group_size"]

        def group(x):
            xg = x.unflatten(-1, (-1, bk))
            s = xg.abs().amax(-1, keepdim=True) / 448
            return _e4m3(xg, torch.where(s > 0, s, 1)).flatten(-2)
        return group
    act = o.get("act", "dynamic")
    if writer in ("fp8-tensor", "ct-fp8") and act == "static":
        s = t[f"{m}.input_scale"].float().reshape(())
        return lambda x: _e4m3(x, s)
    if writer in ("fp8-tensor", "ct-fp8") and act == "dynamic":
        def token(x):
            s = x.abs().amax(-1, keepdim=True) / 448
            return _e4m3(x, torch.where(s > 0, s, 1))
        return token
    return None


WEIGHT = {"fp8-fp4": _fp8_fp4_weight, "fp8-block": _fp8_weight, "fp8-tensor": _fp8_weight, "ct-fp8": _ct_weight,
          "ct-int": _ct_weight, "awq": _awq_weight, "gptq": _gptq_weight, "mxfp4": _mxfp4_weight}


def writer_of(q: dict) -> tuple[str, dict]:
    """(writer, options) of a quantization_config, as tools/quantize_model.py names the format
    (the options _acts reads: act "group" | "static" | "dynamic" | "none")."""
    method = q.get("quant_method")
    if method == "fp8":
        if q.get("scale_fmt", "float") != "float" or q.get("expert_dtype", "fp8") != "fp8":
            return "fp8-fp4", {}
        if q.get("weight_block_size"):
            return "fp8-block", {}
        return "fp8-tensor", {"act": q.get("activation_scheme", "dynamic")}
    if method in ("awq", "gptq", "mxfp4"):
        return method, {}
    if method == "compressed-tensors":
        group = q["config_groups"]["group_0"]
        if group["weights"]["type"] == "float":
            a = group.get("input_activations")
            act = "none" if not a else "group" if a.get("strategy") == "group" else \
                "dynamic" if a.get("dynamic") else "static"
            return "ct-fp8", {"act": act}
        return "ct-int", {}
    raise ValueError(f"no definition here for quant_method {method!r}")


def stored_quantized(t: dict, writer: str) -> list[str]:
    """The modules whose weights the checkpoint's tensors store quantized, for the writer."""
    if writer == "fp8-fp4":
        return sorted(n[:-len(".weight")] for n in t if n.endswith(".weight")
                      and (f"{n[:-7]}.scale" in t or f"{n[:-7]}.weight_scale_inv" in t))
    key = {"fp8-block": ".weight_scale_inv", "fp8-tensor": ".weight_scale_inv", "ct-fp8": ".weight_scale",
           "ct-int": ".weight_scale", "awq": ".qweight", "gptq": ".qweight", "mxfp4": ".weight_blocks"}[writer]
    return sorted(n[:-len(key)] for n in t if n.endswith(key))
