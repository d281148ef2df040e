"""Read safetensors files with numpy alone (bf16 included), memory-mapped.

The safetensors package's numpy loader rejects bf16, and the runtime must not import torch, so
this reads the format directly: an 8-byte little-endian header length, a JSON header of
{name: {dtype, shape, data_offsets}}, then the raw bytes. Every header is checked against its
file (compiler/contract/safetensors_header.py) and every shard path against the model directory
(`shard_path`) when the file is opened, before any tensor byte is mapped.
"""
import json
import os
from pathlib import Path

import numpy as np

from infc.compiler.contract.errors import ModelDirError

from . import json_file
from .safetensors_header import read_header

_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "I32": np.int32,
           "I64": np.int64, "U8": np.uint8, "I8": np.int8, "F64": np.float64, "BOOL": np.bool_,
           "I16": np.int16, "U16": np.uint16, "U32": np.uint32,
           # fp8 and MX scales as their bytes (float32() decodes e4m3)
           "F8_E4M3": np.uint8, "F8_E5M2": np.uint8, "F8_E8M0": np.uint8}


def _e4m3_values() -> np.ndarray:
    """float32 value of each e4m3 byte (OCP e4m3fn: bias 7, no infinities, S.1111.111 is NaN)."""
    b = np.arange(256)
    e, m = (b >> 3) & 15, (b & 7).astype(np.float64)
    v = np.where(e == 0, m / 8 * 2.0 ** -6, (1 + m / 8) * 2.0 ** (e - 7))
    v = np.where((e == 15) & (m == 7), np.nan, v)
    return np.where(b >> 7, -v, v).astype(np.float32)


E4M3 = _e4m3_values()
# OCP MX formats (MXFP4: U8 / F8_E8M0 scales): elements along K that share one e8m0 scale
MX_BLOCK = 32


class SafetensorsFile:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.header, self.base = read_header(self.path)   # checked against the file's size
        self._mm = None

    def names(self) -> list[str]:
        return list(self.header)

    def info(self, name: str) -> tuple[str, tuple]:
        h = self.header[name]
        return h["dtype"], tuple(h["shape"])

    def raw(self, name: str) -> np.ndarray:
        """The tensor as stored (bf16 as uint16 bits), a read-only view of the mapped file."""
        if self._mm is None:
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        h = self.header[name]
        if h["dtype"] not in _DTYPES:
            raise ModelDirError(f"{self.path}: tensor '{name}' has unsupported dtype {h['dtype']}")
        a, b = h["data_offsets"]
        return self._mm[self.base + a: self.base + b].view(_DTYPES[h["dtype"]]).reshape(h["shape"])

    def extent(self, name: str) -> tuple[str, int, int]:
        """(dtype, byte offset in the file, byte length) of a tensor, for direct reads."""
        h = self.header[name]
        a, b = h["data_offsets"]
        return h["dtype"], self.base + a, b - a

    def close(self):
        self._mm = None                 # drop the mapping: mapped pages count as resident

    def bf16_bits(self, name: str) -> np.ndarray:
        """The tensor as bf16 bit patterns (uint16): bf16 as stored, f32/f16 rounded to nearest even."""
        x = self.raw(name)
        dt = self.header[name]["dtype"]
        if dt == "BF16":
            return np.array(x)
        return f32_to_bf16_bits(x.astype(np.float32))

    def float32(self, name: str) -> np.ndarray:
        x = self.raw(name)
        dt = self.header[name]["dtype"]
        if dt == "BF16":
            return (x.astype(np.uint32) << 16).view(np.float32)
        if dt == "F8_E4M3":
            return E4M3[x]
        if dt in ("F8_E5M2", "F8_E8M0"):
            raise ModelDirError(f"{self.path}: tensor '{name}' is {dt}: read as a float only through a "
                                f"quantization format (config.json's quantization_config)")
        return x.astype(np.float32)

    def dtype(self, name: str) -> str:
        return self.header[name]["dtype"]


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    rounded = u + (0x7FFF + ((u >> 16) & 1))
    out = (rounded >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), out)


def shard_path(model_dir: Path, name, where) -> Path:
    """The file a shard name (from model.safetensors.index.json, or found in the directory)
    stands for, confined to the model directory; `where` is named in errors.

    The rule: a shard is named by a plain file name (no directory part, so no absolute path and
    no `..`). The file itself may be a symbolic link, as the user's own directory structure may
    be made of them: resolved, it must be a regular file inside the resolved model directory
    (so a linked model directory is fine) or, when that directory is a hub cache snapshot
    (<repo>/snapshots/<revision>, whose files link to ../../blobs/<hash>), inside its repository's
    blobs/. A link anywhere else (a downloaded directory pointing at ~/.ssh or /etc) is refused."""
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name \
            or os.path.isabs(name):
        raise ModelDirError(f"{where}: shard {name!r} is not a plain file name in the model "
                            f"directory (no directories, no '..', no absolute paths)")
    p = Path(model_dir) / name
    if not p.exists():
        raise ModelDirError(f"{where}: shard '{name}' is missing from {model_dir}")
    real, home = p.resolve(), Path(model_dir).resolve()
    allowed = [home] + ([home.parent.parent / "blobs"] if home.parent.name == "snapshots" else [])
    if not any(real.is_relative_to(a) for a in allowed):
        raise ModelDirError(f"{where}: shard '{name}' is a link to {real}, outside the model "
                            f"directory {home} (copy the file in, or link the whole directory)")
    if not real.is_file():
        raise ModelDirError(f"{where}: shard '{name}' is not a regular file")
    return p


class Checkpoint:
    """All tensors of an HF model directory: one model.safetensors or shards with an index."""

    def __init__(self, model_dir: Path):
        self.dir = Path(model_dir)
        index = self.dir / "model.safetensors.index.json"
        self.where: dict[str, SafetensorsFile] = {}
        if index.exists():
            json_file.check_regular(index)      # a FIFO would block the read forever
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                if not isinstance(weight_map, dict):
                    raise ValueError("'weight_map' is not an object")
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise ModelDirError(f"{index}: invalid index ({e})") from None
            except RecursionError:      # `[[[[...` thousands deep
                raise ModelDirError(f"{index}: invalid index (JSON nested too deeply)") from None
            files = {}
            for name, shard in weight_map.items():
                if not isinstance(shard, str):
                    raise ModelDirError(f"{index}: tensor '{name}' maps to {shard!r}, not a file name")
                if shard not in files:
                    files[shard] = SafetensorsFile(shard_path(self.dir, shard, f"{index} (for '{name}')"))
                if name not in files[shard].header:
                    raise ModelDirError(f"{index}: tensor '{name}' is not in its shard '{shard}'")
                self.where[name] = files[shard]
        else:
            shards = sorted(self.dir.glob("*.safetensors"))
            if not shards:
                raise ModelDirError(f"{self.dir}: no *.safetensors weights")
            for p in shards:
                f = SafetensorsFile(shard_path(self.dir, p.name, self.dir))
                for name in f.names():
                    if name in self.where:      # a stale or second copy: which one is the model's?
                        raise ModelDirError(f"{self.dir}: tensor '{name}' is in both "
                                            f"{self.where[name].path.name} and {p.name}, and no "
                                            f"model.safetensors.index.json says which to read "
                                            f"(remove the file that does not belong)")
                    self.where[name] = f

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def shape(self, name: str) -> tuple:
        return self.where[name].info(name)[1]

    def float32(self, name: str) -> np.ndarray:
        return self._file(name).float32(name)

    def raw(self, name: str) -> np.ndarray:
        """The tensor as stored (bf16 and fp8 as their bits)."""
        return self._file(name).raw(name)

    def dtype(self, name: str) -> str:
        """The tensor's safetensors dtype (F8_E4M3, I32, BF16, ...)."""
        return self._file(name).dtype(name)

    def bf16_bits(self, name: str) -> np.ndarray:
        return self._file(name).bf16_bits(name)

    def locate(self, name: str) -> tuple[SafetensorsFile, str, int, int]:
        """(file, dtype, byte offset, byte length) of a tensor."""
        f = self._file(name)
        return (f, *f.extent(name))

    def close(self):
        for f in set(self.where.values()):
            f.close()

    def _file(self, name: str) -> SafetensorsFile:
        if name not in self.where:
            raise ModelDirError(f"{self.dir}: tensor '{name}' is missing from the checkpoint")
        return self.where[name]
