"""A safetensors header, checked against its file before any tensor byte is used.

The rules are the format's, as the `safetensors` library enforces them when it opens a file
(so every file it writes passes, and every file it refuses is refused here too):

  - 8 bytes: N, the header length (little-endian u64), at most 100,000,000 and inside the file;
  - N bytes: a UTF-8 JSON object {name: {dtype, shape, data_offsets}}, plus an optional
    `__metadata__` map of strings to strings;
  - every dtype is one the format names; every shape a list of non-negative integers;
  - each tensor's data_offsets [begin, end] hold exactly prod(shape) x dtype-size bytes;
  - taken in offset order, the tensors cover the data section contiguously from 0: no hole, no
    two tensors sharing bytes, and the last one ends exactly at the end of the file (a file
    shorter than that is truncated, one longer carries bytes no tensor accounts for).

A failure raises ModelDirError naming the file and, where one is involved, the tensor.
"""
import json
import math
import os
import struct

from infc.compiler.contract.errors import ModelDirError

MAX_HEADER = 100_000_000          # the safetensors library's own limit
# Bits per element of every dtype of the format (sub-byte floats pack: a tensor's bit count
# must be a whole number of bytes).
DTYPE_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8,
              "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
              "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32,
              "I64": 64, "U64": 64, "F64": 64, "C64": 64}


def read_header(path) -> tuple[dict, int]:
    """({name: {dtype, shape, data_offsets}}, byte offset of the data section) of a checked file."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise ModelDirError(f"{path}: not a safetensors file ({size} bytes, shorter than "
                                    f"the 8-byte header length)")
            (n,) = struct.unpack("<Q", f.read(8))
            if n > MAX_HEADER:
                raise ModelDirError(f"{path}: header length {n} is over the format's limit of "
                                    f"{MAX_HEADER} bytes (not a safetensors file?)")
            if 8 + n > size:
                raise ModelDirError(f"{path}: header length {n} runs past the end of the file "
                                    f"({size} bytes): truncated or not a safetensors file")
            raw = f.read(n)
    except OSError as e:
        raise ModelDirError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ModelDirError(f"{path}: the header is not valid UTF-8 JSON ({e})") from None
    except RecursionError:          # `[[[[...` thousands deep
        raise ModelDirError(f"{path}: the header is not valid UTF-8 JSON (nested too deeply)") from None
    if not isinstance(header, dict):
        raise ModelDirError(f"{path}: the header is a JSON {type(header).__name__}, not an object")
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ModelDirError(f"{path}: '__metadata__' must map strings to strings")
    base = 8 + n
    _check_layout(path, header, size - base)
    return header, base


def _nbytes(path, name: str, info) -> int:
    """The byte size a tensor's dtype and shape call for (its entry checked on the way)."""
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
        raise ModelDirError(f"{path}: tensor '{name}': an entry needs dtype, shape and data_offsets")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:    # a list would be unhashable
        raise ModelDirError(f"{path}: tensor '{name}' has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_count(d) for d in shape):
        raise ModelDirError(f"{path}: tensor '{name}' has shape {shape!r}, not a list of "
                            f"non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_count(o) for o in offsets)):
        raise ModelDirError(f"{path}: tensor '{name}' has data_offsets {offsets!r}, not two "
                            f"non-negative integers")
    bits = math.prod(shape) * DTYPE_BITS[dtype]
    if bits % 8:
        raise ModelDirError(f"{path}: tensor '{name}' ({dtype} {shape}) is not a whole number of bytes")
    begin, end = offsets
    if end < begin:
        raise ModelDirError(f"{path}: tensor '{name}' has data_offsets [{begin}, {end}]: the end "
                            f"is before the beginning")
    if end - begin != bits // 8:
        raise ModelDirError(f"{path}: tensor '{name}' has {end - begin} bytes at data_offsets "
                            f"[{begin}, {end}], but {dtype} x {shape} needs {bits // 8}")
    return bits // 8


def _count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _check_layout(path, header: dict, data_len: int) -> None:
    for name, info in header.items():
        _nbytes(path, name, info)
    cursor, prev = 0, None
    for name, info in sorted(header.items(), key=lambda kv: tuple(kv[1]["data_offsets"])):
        begin, end = info["data_offsets"]
        if end > data_len:
            raise ModelDirError(f"{path}: tensor '{name}' ends at byte {end} of the data section, "
                                f"which holds only {data_len} bytes (a truncated file, or an offset "
                                f"past its end)")
        if begin < cursor:
            raise ModelDirError(f"{path}: tensor '{name}' (bytes [{begin}, {end}]) overlaps tensor "
                                f"'{prev}' (which ends at {cursor})")
        if begin > cursor:
            raise ModelDirError(f"{path}: tensor '{name}' starts at byte {begin} of the data, "
                                f"leaving a hole after {'tensor ' + repr(prev) if prev else 'the header'} "
                                f"(which ends at {cursor}): the format covers the data contiguously")
        cursor, prev = end, name
    if cursor != data_len:
        raise ModelDirError(f"{path}: {data_len - cursor} bytes past the last tensor"
                            f"{' ' + repr(prev) if prev else ''} belong to no tensor (the format "
                            f"covers the data exactly)")
