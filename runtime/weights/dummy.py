"""`--load-format dummy` (vLLM's spelling): random weights of the plan's shapes, no checkpoint.

A model directory with only config.json is enough to benchmark a 60 GB model. The values follow
one rule for both backends, chosen to keep activations finite through many layers:

    matrices (2-D and up: projections, embeddings, stacked experts)   0.02 * z
    1-D weights read from a `*bias` tensor                            0.02 * z
    other 1-D weights (norm scales, after any load-time offset)       1 + 0.02 * z
    1-D weights built as exp(w) * s (Qwen3.5's A = -exp(A_log))       s + 0.02 * z (a decay rate:
                                                                      positive ones would grow the
                                                                      linear-attention state)

z is a counter-based hash of (seed, element index) with mean 0 and std 1 (bounded by 3.47): the
GPU fills each weight on the device with the fill_random kernel (plan["weight_init"]), the CPU
backend computes the same hash here in numpy (`values`), so both backends load the same bf16
numbers (bit for bit, but for a double rounding in the fma emulation below at a rate of ~2^-29);
a weight the plan declares f32 keeps the float32 values unrounded (plan["weight_init_f32"]).
Every (weight, layer) gets its own seed, and a weight is filled in chunks of at most 2^30
elements (int32 indices in the kernel), each with its own seed.
"""
import math
import zlib

import numpy as np

from infc.compiler.contract.safetensors_io import f32_to_bf16_bits

LOAD_FORMATS = ("auto", "dummy")
CHUNK = 1 << 30                          # elements per fill launch
STD = 0.02
Z_SCALE = np.float32(math.sqrt(3) / 65536)


def check_load_format(load_format: str) -> str:
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"--load-format must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}")
    return load_format


def _first_tensor(src: dict) -> str | None:
    """The first checkpoint tensor name a recipe reads (what the weight 'is', for the rule)."""
    if "tensor" in src:
        return src["tensor"]
    if "stack" in src and isinstance(src["stack"], str):
        return src["stack"]
    for v in src.values():
        for x in (v if isinstance(v, list) else [v]):
            if isinstance(x, dict) and (name := _first_tensor(x)):
                return name
    return None


def rule(w: dict) -> tuple[float, float]:
    """(scale, offset) of a plan weight: out = z * scale + offset."""
    src = w["source"]
    if len(w["shape"]) >= 2 or (_first_tensor(src) or "").endswith("bias"):
        return STD, 0.0
    if "scale" in src and "exp" in src["scale"]:
        return STD, float(src["by"])     # exp(w) * s: near s, with s's sign
    return STD, 1.0                      # a norm scale: near 1, as trained ones are


def seed_of(name: str, layer, chunk: int = 0, seed: int = 0) -> int:
    """A 31-bit seed per (weight, layer, chunk): the kernel takes it as an i32."""
    return zlib.crc32(f"{seed}:{name}:{layer}:{chunk}".encode()) & 0x7FFFFFFF


def _mix(x: np.ndarray) -> np.ndarray:
    # lowbias32, as the kernel's _mix (uint32 arithmetic wraps)
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x7FEB352D)
    x = x ^ (x >> np.uint32(15))
    x = x * np.uint32(0x846CA68B)
    return x ^ (x >> np.uint32(16))


def values(n: int, seed: int, scale: float, offset: float) -> np.ndarray:
    """The fill_random kernel's n float32 values (before its rounding to the output dtype)."""
    i = np.arange(n, dtype=np.uint32)
    a = _mix(_mix(i) ^ np.uint32(seed))
    b = _mix(a + np.uint32(0x9E3779B9))
    m = np.uint32(0xFFFF)
    s = (a & m) + (a >> np.uint32(16)) + (b & m) + (b >> np.uint32(16))
    z = (s.astype(np.int32) - 131070).astype(np.float32) * Z_SCALE
    # the kernel's fma(z, scale, offset), f32 parameters: the f64 product of two f32 is exact
    out = z.astype(np.float64) * np.float64(np.float32(scale)) + np.float64(np.float32(offset))
    return out.astype(np.float32)


def chunks(n: int):
    """(start, length, chunk index) of the fill launches of an n-element weight."""
    for c, start in enumerate(range(0, n, CHUNK)):
        yield start, min(CHUNK, n - start), c


def weight_values(name: str, w: dict, layer, seed: int = 0) -> np.ndarray:
    """One weight's values as the GPU loads them (bf16-rounded, unless the weight is f32), in
    float32 and its shape."""
    n = math.prod(w["shape"])
    scale, offset = rule(w)
    out = np.empty(n, np.float32)
    for start, length, c in chunks(n):
        out[start: start + length] = values(length, seed_of(name, layer, c, seed), scale, offset)
    if w.get("dtype") == "f32":
        return out.reshape(w["shape"])
    bits = f32_to_bf16_bits(out).astype(np.uint32) << 16
    return bits.view(np.float32).reshape(w["shape"])


def dummy_weights(plan: dict, seed: int = 0) -> dict:
    """The CPU backend's weights for --load-format dummy: load_weights' structure (name -> array,
    or a list ordered like the weight's `layers`; tied weights share their target's)."""
    from .load import layers_of
    out, tied = {}, []
    for name, w in plan["weights"].items():
        if "tied" in w["source"]:
            tied.append((name, w["source"]["tied"]))
            continue
        arrays = [weight_values(name, w, layer, seed) for layer in layers_of(w)]
        out[name] = arrays[0] if w["layers"] is None else arrays
    for name, target in tied:
        out[name] = out[target]
    return out
