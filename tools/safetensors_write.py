"""A safetensors file written directly from numpy arrays (numpy has no bfloat16 or fp8, so each
array comes with the safetensors dtype its bytes are): the fixture tools' one writer."""
import json
import struct
from pathlib import Path

import numpy as np


def write_raw(path: Path, tensors: dict, metadata: dict | None = None) -> None:
    """tensors: name -> (safetensors dtype, array holding that dtype's bytes), written in name order."""
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    blobs, offset = [], 0
    for name in sorted(tensors):
        dt, a = tensors[name]
        data = np.ascontiguousarray(a).tobytes()
        header[name] = {"dtype": dt, "shape": list(a.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for b in blobs:
            f.write(b)
