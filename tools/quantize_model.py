"""Quantized checkpoints from a bf16 / f32 HF model directory, written as each format publishes
them (the fixtures of issue 42: no hub needed).

    python tools/quantize_model.py --format fp8-block --src DIR --out DIR [--workers N]

Every 2-D linear weight of a decoder layer (`model.layers.N.*.weight` but MoE routers and norms)
is quantized, MoE experts too (each `mlp.experts.E.*_proj`, as Qwen3-30B-A3B-FP8 and Kimi-K2
store them; MXFP4 as `weight_blocks` / `weight_scales` per expert, the dense layout);
embeddings, lm_head and norms are copied as they are, and config.json gains the format's
`quantization_config`, with lm_head and the routers (`model.layers.N.mlp.gate`, named per layer
as Qwen3-30B-A3B-FP8's modules_to_not_convert names them) in its ignore list. The quantization math is the
format's own definition (checked in tests against the format's library where it installs).

`fp8-fp4` writes DeepSeek-V4-Flash's layout (fp8 linears with ue8m0 block scales, fp4 routed
experts, the scales named `.scale`, the routers and its `plain` modules bf16 and listed nowhere).

Python API: quantize_model(src, out, fmt, **options) -> the quantization_config written. Option
`keep` (every format): module name suffixes left unquantized (e.g. ["mlp.down_proj"]), listed in
the config's ignore list as the format spells it.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import shutil
import sys
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from pathlib import Path

import numpy as np


from infc.compiler.contract.errors import ModelDirError  # noqa: E402
from infc.compiler.contract.safetensors_io import Checkpoint  # noqa: E402
from infc.compiler.quant.formats import parse_quantization  # noqa: E402
from infc.compiler.quant.scheme import MX_BLOCK  # noqa: E402
from infc.runtime.weights.quant_pack import encode_e4m3, pack_nibbles  # noqa: E402
from safetensors_write import write_raw  # noqa: E402
from quant_math import (act_order_gidx, fp8_block_quantize, int_quantize, mxfp4_quantize,  # noqa: E402
                        pack_words, rng_for)

# format name -> writer(name, w float32 [N, K], options) -> {tensor name: (dtype, array)}
WRITERS: dict = {}
CONFIGS: dict = {}          # format name -> quantization_config(options)
_LINEAR = re.compile(r"^(.*\.layers\.\d+\..*)\.weight$")
_NOT_LINEAR = re.compile(r"(norm|\.gate\.weight$|embed)")


OPTIONS: dict = {}          # format name -> the options its writer takes (beside `keep`)
UNLISTED = {"fp8-fp4"}      # formats whose routers stay bf16 unlisted (the tensors say it)


def writer(name: str, config, options=()):
    def register(fn):
        WRITERS[name], CONFIGS[name], OPTIONS[name] = fn, config, set(options) | {"keep"}
        return fn
    return register


def quantized_module(name: str, shape) -> str | None:
    """The module a tensor is the weight of, when the fixtures quantize it."""
    m = _LINEAR.match(name)
    if m is None or len(shape) != 2 or _NOT_LINEAR.search(name):
        return None
    return m.group(1)


def router_module(name: str, shape) -> str | None:
    """The module a tensor is the weight of when it is an MoE router the fixtures leave bf16."""
    m = _LINEAR.match(name)
    return m.group(1) if m and len(shape) == 2 and name.endswith(".gate.weight") else None


def write_safetensors(path: Path, tensors: dict):
    """tensors: name -> (safetensors dtype, numpy array of that dtype's bytes)."""
    write_raw(path, tensors)


# ---- quant_method fp8 (Qwen3-*-FP8, DeepSeek-V3): e4m3 in blocks, weight_scale_inv per block ----
@writer("fp8-block", lambda o: {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                "weight_block_size": list(o.get("block", (128, 128))),
                                "modules_to_not_convert": ["lm_head"]}, options=("block",))
def _fp8_block(module, w, o):
    q, s = fp8_block_quantize(w, *o.get("block", (128, 128)))
    return {f"{module}.weight": ("F8_E4M3", encode_e4m3(q)), f"{module}.weight_scale_inv": ("F32", s)}


# ---- quant_method fp8 as DeepSeek-V4 ships it: e4m3 linears in blocks with ue8m0 scales, the
# routed experts (`...experts.E.*`) fp4 (I8 [N, K/2], e2m1 two a byte, the even element in the low
# nibble) with one ue8m0 scale a row and 32 columns. Options: block, scale_fmt (ue8m0 | float),
# scale_name (`scale`, the checkpoint's own spelling | `weight_scale_inv`, transformers'),
# expert_dtype_at (config: in quantization_config | top: beside it, as V4 ships it), plain (module
# suffixes stored bf16 and listed nowhere, as V4 stores its compressor / indexer projections) ----
def _fp8_fp4_config(o):
    q = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
         "weight_block_size": list(o.get("block", (128, 128))), "scale_fmt": o.get("scale_fmt", "ue8m0")}
    if o.get("expert_dtype_at", "config") == "config":
        q["expert_dtype"] = "fp4"
    return q


def _scales(s: np.ndarray, o) -> tuple:
    """Scales (powers of two where ue8m0) as the checkpoint stores them."""
    if o.get("scale_fmt", "ue8m0") == "ue8m0":
        return "F8_E8M0", (np.log2(s).astype(np.int32) + 127).astype(np.uint8)
    return "F32", s.astype(np.float32)


@writer("fp8-fp4", _fp8_fp4_config, options=("block", "scale_fmt", "scale_name", "expert_dtype_at", "plain"))
def _fp8_fp4(module, w, o):
    scale = f"{module}.{o.get('scale_name', 'scale')}"
    if ".experts." in module:
        n, k = w.shape
        if k % MX_BLOCK:
            raise ValueError(f"fp8-fp4: expert {module} has K = {k}, not a multiple of {MX_BLOCK}")
        codes, exps = mxfp4_quantize(w)
        s = np.ldexp(np.float32(1), exps.astype(np.int32) - 127)
        return {f"{module}.weight": ("I8", pack_nibbles(codes).view(np.int8)), scale: _scales(s, o)}
    q, s = fp8_block_quantize(w, *o.get("block", (128, 128)), pow2=o.get("scale_fmt", "ue8m0") == "ue8m0")
    return {f"{module}.weight": ("F8_E4M3", encode_e4m3(q)), scale: _scales(s, o)}


def _static_input_scale(module: str) -> np.ndarray:
    """A fixture's static activation scale (no calibration data): one per module, different
    across modules so that mixing them up shows."""
    return np.array([0.01 + 0.02 * rng_for(module).random()], np.float32)


# per-tensor fp8 (quant_method fp8 without weight_block_size): option act "dynamic" | "static"
@writer("fp8-tensor", lambda o: {"quant_method": "fp8", "fmt": "e4m3",
                                 "activation_scheme": o.get("act", "dynamic"),
                                 "modules_to_not_convert": ["lm_head"]}, options=("act",))
def _fp8_tensor(module, w, o):
    q, s = fp8_block_quantize(w, w.shape[0], None)
    out = {f"{module}.weight": ("F8_E4M3", encode_e4m3(q)), f"{module}.weight_scale_inv": ("F32", s[0])}
    if o.get("act", "dynamic") == "static":
        out[f"{module}.input_scale"] = ("F32", _static_input_scale(module))
    return out


# ---- compressed-tensors (llm-compressor) ----
def _ct_config(weights: dict, fmt: str, acts=None) -> dict:
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": acts, "output_activations": None,
                                          "format": fmt}},
            "ignore": ["lm_head"], "kv_cache_scheme": None}


def _ct_fp8_config(o):
    strategy = o.get("strategy", "channel")
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy,
               "dynamic": False, "group_size": o.get("group") if strategy == "group" else None,
               "block_structure": list(o["block"]) if strategy == "block" else None}
    act = o.get("act", "dynamic")
    acts = None if act == "none" else {"num_bits": 8, "type": "float", "symmetric": True,
                                       "strategy": {"dynamic": "token", "static": "tensor"}.get(act, act),
                                       "dynamic": act != "static"}
    if act == "group":           # llm-compressor's FP8_BLOCK: activations per token in groups of bk
        acts["group_size"] = list(o.get("block", (128, 128)))[1]
    return _ct_config(weights, "float-quantized", acts)


# float-quantized fp8: options strategy tensor|channel|group|block (group=, block=(bn, bk)),
# act dynamic (per token) | group (per token, groups of the block's columns) | static (per tensor) | none
@writer("ct-fp8", _ct_fp8_config, options=("strategy", "group", "block", "act"))
def _ct_fp8(module, w, o):
    strategy = o.get("strategy", "channel")
    n = w.shape[0]
    bn, bk = {"tensor": (n, None), "channel": (1, None), "group": (1, o.get("group")),
              "block": tuple(o.get("block", (128, 128)))}[strategy]
    q, s = fp8_block_quantize(w, bn, bk)
    out = {f"{module}.weight": ("F8_E4M3", encode_e4m3(q)),
           f"{module}.weight_scale": ("F32", s.reshape(1) if strategy == "tensor" else s)}
    if o.get("act", "dynamic") == "static":
        out[f"{module}.input_scale"] = ("F32", _static_input_scale(module))
    return out


def _ct_int_config(o):
    group = o.get("group")
    weights = {"num_bits": o.get("bits", 4), "type": "int", "symmetric": o.get("sym", True),
               "strategy": "group" if group else "channel", "group_size": group, "dynamic": False,
               "actorder": "group" if o.get("act_order") else None}
    return _ct_config(weights, o.get("format", "pack-quantized"))


def _gidx(module: str, k: int, group: int | None, act_order: bool) -> np.ndarray:
    if act_order:
        return act_order_gidx(k, group, rng_for(module))
    return (np.arange(k) // group if group else np.zeros(k)).astype(np.int32)


# W4A16 / W8A16: options bits 4|8, group (None: per channel), sym, act_order, format
# pack-quantized | naive-quantized
@writer("ct-int", _ct_int_config, options=("bits", "group", "sym", "act_order", "format"))
def _ct_int(module, w, o):
    bits, group, sym = o.get("bits", 4), o.get("group"), o.get("sym", True)
    n, k = w.shape
    gidx = _gidx(module, k, group, o.get("act_order", False))
    groups = -(-k // group) if group else 1
    codes, scale, zero = int_quantize(w, bits, gidx, groups, sym)
    half = 1 << (bits - 1)
    packed = o.get("format", "pack-quantized") == "pack-quantized"
    out = {f"{module}.weight_scale": ("F32", scale),
           f"{module}.weight_shape": ("I64", np.array([n, k], np.int64))}
    if packed:
        out[f"{module}.weight_packed"] = ("I32", pack_words(codes, bits, 1))
    else:
        out[f"{module}.weight"] = ("I8", (codes - half).astype(np.int8))
    if not sym:
        out[f"{module}.weight_zero_point"] = ("I32", pack_words(zero, bits, 0)) if packed \
            else ("I8", (zero - half).astype(np.int8))
    if o.get("act_order"):
        out[f"{module}.weight_g_idx"] = ("I32", gidx)
    return out


# ---- AutoAWQ GEMM: 4-bit asymmetric, [K, N] packed along N in AWQ's order; option group ----
@writer("awq", lambda o: {"quant_method": "awq", "bits": 4, "group_size": o.get("group", 128),
                          "zero_point": True, "version": "gemm", "modules_to_not_convert": ["lm_head"]},
        options=("group",))
def _awq(module, w, o):
    group = o.get("group", 128)
    k = w.shape[1]
    codes, scale, zero = int_quantize(w, 4, np.arange(k) // group, -(-k // group), False, np.float16)
    return {f"{module}.qweight": ("I32", pack_words(codes.T, 4, 1, "awq")),
            f"{module}.qzeros": ("I32", pack_words(zero.T, 4, 1, "awq")),
            f"{module}.scales": ("F16", scale.T.astype(np.float16))}


# ---- GPTQ: [K, N] packed along K; options bits 4|8, group (-1: per channel), sym, desc_act,
# checkpoint_format gptq (v1: qzeros hold zero - 1) | gptq_v2 ----
@writer("gptq", lambda o: {"quant_method": "gptq", "bits": o.get("bits", 4), "group_size": o.get("group", 128),
                           "desc_act": o.get("desc_act", False), "sym": o.get("sym", True),
                           "checkpoint_format": o.get("checkpoint_format", "gptq"),
                           "damp_percent": 0.01, "true_sequential": True},
        options=("bits", "group", "sym", "desc_act", "checkpoint_format"))
def _gptq(module, w, o):
    bits, group, sym = o.get("bits", 4), o.get("group", 128), o.get("sym", True)
    v1 = o.get("checkpoint_format", "gptq") == "gptq"
    n, k = w.shape
    g = None if group == -1 else group
    gidx = _gidx(module, k, g, o.get("desc_act", False))
    groups = -(-k // g) if g else 1
    # v1 cannot store a zero point of 0 (it stores zero - 1 unsigned)
    codes, scale, zero = int_quantize(w, bits, gidx, groups, sym, np.float16,
                                      (1, (1 << bits) - 1) if v1 else None)
    return {f"{module}.qweight": ("I32", pack_words(codes.T, bits, 0)),
            f"{module}.qzeros": ("I32", pack_words(zero.T - (1 if v1 else 0), bits, 1)),
            f"{module}.scales": ("F16", scale.T.astype(np.float16)),
            f"{module}.g_idx": ("I32", gidx.astype(np.int32))}


# ---- MXFP4 (GPT-OSS's layout, for a dense linear): `weight_blocks` + `weight_scales` ----
@writer("mxfp4", lambda o: {"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]}, options=())
def _mxfp4(module, w, o):
    n, k = w.shape
    if k % MX_BLOCK:
        raise ValueError(f"mxfp4: {module} has K = {k}, not a multiple of the {MX_BLOCK}-element block")
    codes, exps = mxfp4_quantize(w)
    return {f"{module}.weight_blocks": ("U8", pack_nibbles(codes).reshape(n, k // MX_BLOCK, MX_BLOCK // 2)),
            f"{module}.weight_scales": ("U8", exps)}


_OPEN: dict = {}            # a worker process's open checkpoint, by directory


def _quantize_one(src: str, fmt: str, options: dict, name: str) -> dict:
    """One tensor through the format's writer (in a worker process: its own mapping of the file)."""
    ckpt = _OPEN.get(src) or _OPEN.setdefault(src, Checkpoint(src))
    return WRITERS[fmt](quantized_module(name, ckpt.shape(name)), ckpt.float32(name), options)


def quantization_config(fmt: str, options: dict, routers=()) -> dict:
    """The quantization_config the writer records: the format's, with the modules kept
    unquantized (options["keep"], and the MoE routers it finds) in the format's own ignore list."""
    q = CONFIGS[fmt](options)
    parse_quantization({"quantization_config": q}, f"{fmt} options {options}")   # a config infc reads
    keep, routers = list(options.get("keep", [])), list(routers)
    if q["quant_method"] == "compressed-tensors":
        q["ignore"] += [rf"re:.*\.{re.escape(k)}$" for k in keep] + routers
    elif keep or routers:
        q["modules_to_not_convert"] = (q.get("modules_to_not_convert") or []) + keep + routers
    return q


def quantize_model(src, out, fmt: str, workers: int | None = None, **options) -> dict:
    """workers: processes quantizing tensors at once (default: every CPU). Processes, so that no
    part of numpy that holds the GIL serializes them. Measured on an H200 machine's 16 cores:
    Qwen3-4B's 252 matrices in 15.6 s (and 4.6 s to write the file), where the per-block loop in
    one process took 275 s."""
    if fmt not in WRITERS:
        raise ValueError(f"unknown format {fmt!r} (known: {', '.join(sorted(WRITERS))})")
    unknown = set(options) - OPTIONS[fmt]
    if unknown:
        raise ValueError(f"{fmt}: unknown option(s) {', '.join(sorted(unknown))} (it takes: "
                         f"{', '.join(sorted(OPTIONS[fmt]))})")
    q = quantization_config(fmt, options)
    src, out = Path(src), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = Checkpoint(src)
    keep = options.get("keep", []) + options.get("plain", [])
    names = list(ckpt.where)
    quantized = [n for n in names if (m := quantized_module(n, ckpt.shape(n))) is not None
                 and not any(m.endswith("." + k) for k in keep)]
    tensors = {n: (ckpt.dtype(n), np.array(ckpt.raw(n))) for n in sorted(set(names) - set(quantized))}
    routers = sorted(m for n in names if (m := router_module(n, ckpt.shape(n))) is not None)
    ckpt.close()
    one = partial(_quantize_one, str(src), fmt, options)
    workers = min(workers or os.cpu_count() or 1, max(len(quantized), 1))
    if workers == 1:
        parts = map(one, quantized)
    else:      # fork: the workers inherit the writers (a script's own module included)
        pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"))
        parts = pool.map(one, quantized)
    try:
        for part in parts:
            tensors.update(part)
    finally:
        if workers > 1:
            pool.shutdown()
        if str(src) in _OPEN:                      # workers == 1 opened it here
            _OPEN.pop(str(src)).close()
    write_safetensors(out / "model.safetensors", tensors)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name not in (
                "model.safetensors.index.json", "config.json"):
            shutil.copy(f, out / f.name)
    config = json.loads((src / "config.json").read_text())
    # a format whose checkpoints leave their routers bf16 without listing them (fp8-fp4: DeepSeek-V4)
    config["quantization_config"] = q = quantization_config(fmt, options, routers if fmt not in UNLISTED else ())
    if fmt == "fp8-fp4" and options.get("expert_dtype_at", "config") == "top":
        config["expert_dtype"] = "fp4"
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return config["quantization_config"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--format", required=True, choices=sorted(WRITERS))
    ap.add_argument("--src", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--options", default="{}", type=json.loads,
                    help='the writer\'s options as JSON, e.g. \'{"bits": 4, "group": 128, "sym": false}\'')
    ap.add_argument("--workers", type=int, default=None, help="processes quantizing tensors at once "
                                                               "(default: every CPU)")
    args = ap.parse_args(argv)
    try:
        print(json.dumps(quantize_model(args.src, args.out, args.format, workers=args.workers,
                                        **args.options)))
    except (ValueError, ModelDirError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
