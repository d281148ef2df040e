"""The FP8 KV cache's per-tensor scales, read from a checkpoint as vLLM reads them.

A checkpoint calibrated for an FP8 KV cache stores one scalar per layer for K and one for V
(value = code * scale). vLLM (model_loader/weight_utils.py maybe_remap_kv_scale_name) accepts, under
a layer's `...layers.{i}.self_attn.`:
    k_scale / v_scale                    compressed-tensors, llm-compressor
    attn.k_scale / attn.v_scale          vLLM's own module names
    k_proj.k_scale / v_proj.v_scale      NVIDIA ModelOpt
    kv_scale                             deprecated: one scale for both K and V
A layer without one takes 1.0 (vLLM's default without calibration).
"""
import math
import re

import numpy as np

from .contract.errors import ModelDirError

# (the part after `self_attn.`) -> the caches it scales
SUFFIXES = {"k_scale": ("k",), "v_scale": ("v",), "attn.k_scale": ("k",), "attn.v_scale": ("v",),
            "k_proj.k_scale": ("k",), "v_proj.v_scale": ("v",), "kv_scale": ("k", "v")}
_NAME = re.compile(r"^(?:.*\.)?layers\.(\d+)\.self_attn\.(" +
                   "|".join(re.escape(s) for s in sorted(SUFFIXES, key=len, reverse=True)) + r")$")
DEFAULT_SCALE = 1.0


def is_kv_scale(name: str) -> bool:
    """Whether a checkpoint tensor is a KV cache scale (read by the FP8 KV cache, else unused)."""
    return _NAME.match(name) is not None


def read_kv_scales(checkpoint) -> dict[str, dict[int, float]]:
    """{"k": {layer: scale}, "v": {layer: scale}} of the layers a compiler.contract.safetensors_io
    Checkpoint (anything with tensor names, shape(name) and float32(name)) has scales for; the
    others take DEFAULT_SCALE. A scale that is not one positive finite number fails, naming it."""
    found: dict[tuple[str, int], tuple[float, str]] = {}
    for name in checkpoint.where:
        m = _NAME.match(name)
        if m is None:
            continue
        layer, suffix = int(m.group(1)), m.group(2)
        x = np.asarray(checkpoint.float32(name), np.float64).reshape(-1)
        if x.size != 1 or not math.isfinite(float(x[0])) or float(x[0]) <= 0:
            raise ModelDirError(f"{checkpoint.dir}: KV cache scale '{name}' must be one positive finite "
                                f"number (a per-tensor scale), got shape {tuple(checkpoint.shape(name))} "
                                f"values {x[:4].tolist()}")
        for cache in SUFFIXES[suffix]:
            have = found.get((cache, layer))
            if have is not None and have[0] != float(x[0]):
                raise ModelDirError(f"{checkpoint.dir}: layer {layer} has two {cache} scales: "
                                    f"'{have[1]}' = {have[0]} and '{name}' = {float(x[0])}")
            found[(cache, layer)] = (float(x[0]), name)
    return {c: {layer: v for (cc, layer), (v, _) in sorted(found.items()) if cc == c} for c in ("k", "v")}
