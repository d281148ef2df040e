"""Quantized checkpoints from a bf16 / f32 HF model directory, written as each format publishes
them (the fixtures of issue 42: no hub needed).

    python tools/quantize_model.py --format fp8-block --src DIR --out DIR

Every 2-D linear weight of a decoder layer (`model.layers.N.*.weight` but MoE routers and norms)
is quantized; embeddings, lm_head and norms are copied as they are, and config.json gains the
format's `quantization_config` (with lm_head in its ignore list). The quantization math is the
format's own definition (checked in tests against the format's library where it installs).

Python API: quantize_model(src, out, fmt, **options) -> the quantization_config written.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import struct
import sys
from pathlib import Path

import numpy as np


from infc.compiler.contract.safetensors_io import Checkpoint  # noqa: E402
from infc.compiler.ops.quant import round_e4m3  # noqa: E402
from infc.compiler.quant.scheme import FP8_MAX  # noqa: E402
from infc.runtime.weights.quant_pack import encode_e4m3  # noqa: E402

# format name -> writer(name, w float32 [N, K], options) -> {tensor name: (dtype, array)}
WRITERS: dict = {}
CONFIGS: dict = {}          # format name -> quantization_config(options)
_LINEAR = re.compile(r"^(.*\.layers\.\d+\..*)\.weight$")
_NOT_LINEAR = re.compile(r"(norm|\.gate\.weight$|embed)")


def writer(name: str, config):
    def register(fn):
        WRITERS[name], CONFIGS[name] = fn, config
        return fn
    return register


def quantized_module(name: str, shape) -> str | None:
    """The module a tensor is the weight of, when the fixtures quantize it."""
    m = _LINEAR.match(name)
    if m is None or len(shape) != 2 or _NOT_LINEAR.search(name):
        return None
    return m.group(1)


def write_safetensors(path: Path, tensors: dict):
    """tensors: name -> (safetensors dtype, numpy array of that dtype's bytes)."""
    header, blobs, pos = {}, [], 0
    for name in sorted(tensors):
        dt, a = tensors[name]
        b = np.ascontiguousarray(a).tobytes()
        header[name] = {"dtype": dt, "shape": list(a.shape), "data_offsets": [pos, pos + len(b)]}
        blobs.append(b)
        pos += len(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


# ---- quant_method fp8 (Qwen3-*-FP8, DeepSeek-V3): e4m3 in blocks, weight_scale_inv per block ----
def fp8_block_quantize(w: np.ndarray, bn: int, bk: int):
    """(e4m3 values [N, K], scale [ceil(N/bn), ceil(K/bk)]): s = amax(block) / 448, q = e4m3(w / s)."""
    n, k = w.shape
    s = np.zeros((-(-n // bn), -(-k // bk)), np.float32)
    q = np.zeros_like(w, dtype=np.float32)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]
            amax = np.abs(blk).max()
            s[i, j] = amax / np.float32(FP8_MAX) if amax > 0 else 1.0
            q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = round_e4m3(blk / s[i, j])
    return q, s


@writer("fp8-block", lambda o: {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                "weight_block_size": list(o.get("block", (128, 128))),
                                "modules_to_not_convert": ["lm_head"]})
def _fp8_block(module, w, o):
    q, s = fp8_block_quantize(w, *o.get("block", (128, 128)))
    return {f"{module}.weight": ("F8_E4M3", encode_e4m3(q)), f"{module}.weight_scale_inv": ("F32", s)}


def quantize_model(src, out, fmt: str, **options) -> dict:
    if fmt not in WRITERS:
        raise ValueError(f"unknown format {fmt!r} (known: {', '.join(sorted(WRITERS))})")
    src, out = Path(src), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = Checkpoint(src)
    tensors = {}
    for name in ckpt.where:
        module = quantized_module(name, ckpt.shape(name))
        if module is None:
            dt = ckpt.dtype(name)
            tensors[name] = (dt, np.array(ckpt.raw(name)))
        else:
            tensors.update(WRITERS[fmt](module, ckpt.float32(name), options))
    ckpt.close()
    write_safetensors(out / "model.safetensors", tensors)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name not in (
                "model.safetensors.index.json", "config.json"):
            shutil.copy(f, out / f.name)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = CONFIGS[fmt](options)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return config["quantization_config"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--format", required=True, choices=sorted(WRITERS))
    ap.add_argument("--src", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args(argv)
    print(json.dumps(quantize_model(args.src, args.out, args.format)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
