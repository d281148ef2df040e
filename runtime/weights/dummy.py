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

A quantized plan's weights (compiler/quant/scheme.py; which weight is which:
compiler/contract/weight_roles.py) are random but valid, and dequantize to the matrices above
(0.02-std elements), so a dummy quantized model keeps its activations as bounded as a bf16 one:

    f8e4m3 codes        uniform random bytes, the NaN 0x7f / 0xff made 0x7e / 0xfe (+-448)
    u8 / u4 / e2m1      uniform random bytes (every code of these is valid)
    w_scale             (0.02 / CODE_STD[codes]) * (1 + 0.05 * z): positive; CODE_STD is the root
                        mean square of value(code) - zero over those codes, so W's elements have
                        the bf16 matrices' 0.02 RMS (e4m3: heavy-tailed, but |W| <= 448 * 0.02 /
                        107 = 0.084); MXFP4's (e2m1, 32-column groups)
                        that value's nearest power of two, unjittered (e8m0 holds nothing else,
                        and the fp4 experts' kernels read a scale as its exponent byte): 2^-7,
                        W's RMS 0.023
    w_zero              floor(2^(bits-1) + 0.5 + spread * z): an integer zero point near the
                        middle of the code range, inside it (u4: 1..15, u8: 17..239)
    w_gidx              k // block_k: each column's group, valid for act-order kernels too
    x_scale             0.02 * (1 + 0.05 * z): a static activation scale covering |x| <= ~9,
                        the normed activations' range (larger values saturate, as e4m3 does)
"""
import math
import zlib

import numpy as np

from infc.compiler.contract.safetensors_io import E4M3, f32_to_bf16_bits
from infc.compiler.contract.schema import nbytes
from infc.compiler.contract.weight_roles import fill_kind, is_derived, is_mx_scale, quant_roles
from .quant_pack import E2M1, unpack_nibbles

LOAD_FORMATS = ("auto", "dummy")
CHUNK = 1 << 30                          # elements per fill launch
STD = 0.02
Z_SCALE = np.float32(math.sqrt(3) / 65536)
JITTER = 0.05                            # scales vary by 5 % around their value
ZERO_SPREAD = {4: 2.0, 8: 32.0}          # zero points' std, by code bits
X_SCALE = 0.02


def _e4m3_finite(b: np.ndarray) -> np.ndarray:
    """The e4m3 fill's bytes from random bytes: NaN (0x7f / 0xff) made +-448 (0x7e / 0xfe)."""
    return np.where((b & 0x7F) == 0x7F, b - 1, b).astype(np.uint8)


def _rms(v) -> float:
    return float(np.sqrt(np.mean(np.square(np.asarray(v, np.float64)))))


_BYTES = np.arange(256, dtype=np.uint8)
# root mean square of value(code) - zero over the dummy codes (each byte equally likely; the
# symmetric integers' implied zero): the w_scale rule's divisor
CODE_STD = {"f8e4m3": _rms(E4M3[_e4m3_finite(_BYTES)]), "u8": _rms(_BYTES - 128.0),
            "u4": _rms(np.arange(16) - 8.0), "e2m1": _rms(E2M1)}


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


def rule(w: dict, role=None) -> tuple[float, float]:
    """(scale, offset) of a plan weight: out = z * scale + offset. role: the weight's entry in
    compiler/contract/weight_roles.quant_roles (a quantized linear's codes or companion)."""
    if role is not None:
        what, scheme, _ = role
        bits = 4 if scheme["codes"] in ("u4", "e2m1") else 8
        if what == "w_scale":
            base = STD / CODE_STD[scheme["codes"]]
            if is_mx_scale(role):
                return 0.0, float(2.0 ** round(math.log2(base)))     # MX: e8m0, a power of two
            return JITTER * base, base
        if what == "w_zero":
            return ZERO_SPREAD[bits], float(1 << (bits - 1)) + 0.5
        if what == "x_scale":
            return JITTER * X_SCALE, X_SCALE
    src = w["source"]
    if len(w["shape"]) >= 2 or (_first_tensor(src) or "").endswith("bias"):
        return STD, 0.0
    if "scale" in src and "exp" in src["scale"]:
        return STD, float(src["by"])     # exp(w) * s: near s, with s's sign
    return STD, 1.0                      # a norm scale: near 1, as trained ones are


def fill_elements(w: dict, kind: str) -> int:
    """The elements a weight's fill writes: bytes for the byte kind (u4 / e2m1 pack two codes
    a byte), else the weight's elements."""
    return nbytes(w["dtype"], w["shape"]) if kind == "bytes" else math.prod(w["shape"])


def fill_args(name: str, w: dict, role, layer, start: int, n: int, c: int, seed: int = 0) -> dict:
    """The fill kernel's named arguments (arg:...) for chunk c (elements start..start+n) of one
    weight region; every kind's names, each kernel reads its own."""
    scale, offset = rule(w, role)
    period = w["shape"][-1]
    div = (role[1].get("block_k") if role else None) or period
    if fill_kind(w, role) == "index" and (start % period or n % period):
        raise ValueError(f"weight '{name}': a group-index fill chunk must hold whole rows of {period}")
    return {"seed": seed_of(name, layer, c, seed), "scale": scale, "offset": offset,
            "period": period, "div": div}


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


def fill_values(name: str, w: dict, layer, role=None, seed: int = 0) -> np.ndarray:
    """What the fill kernels write into one weight region (flat, the storage dtype's numpy
    type: uint16 bf16 bits, float32, int32 or uint8 bytes / e4m3 codes)."""
    kind = fill_kind(w, role)
    total = fill_elements(w, kind)
    parts = []
    for start, n, c in chunks(total):
        a = fill_args(name, w, role, layer, start, n, c, seed)
        if kind == "index":
            i = np.arange(start, start + n, dtype=np.int64)
            parts.append(((i % a["period"]) // a["div"]).astype(np.int32))
            continue
        if kind in ("bytes", "f8e4m3"):
            x = _mix(_mix(np.arange(n, dtype=np.uint32)) ^ np.uint32(a["seed"]))
            b = (x >> np.uint32(24)).astype(np.uint8)
            parts.append(_e4m3_finite(b) if kind == "f8e4m3" else b)
            continue
        v = values(n, a["seed"], a["scale"], a["offset"])
        parts.append({"bf16": f32_to_bf16_bits, "f32": lambda x: x, "round": np.floor}[kind](v))
    return np.concatenate(parts) if parts else np.zeros(0, np.float32)


def weight_values(name: str, w: dict, layer, seed: int = 0, role=None) -> np.ndarray:
    """One weight's values as the GPU loads them, in float32 and its shape: bf16-rounded (unless
    the weight is f32); a quantized weight's codes as the values they encode (the numpy
    loader's canonical form, compiler/quant/scheme.py)."""
    raw = fill_values(name, w, layer, role, seed)
    dtype, shape = w.get("dtype"), w["shape"]
    if dtype in ("f32", "i32", "u8"):
        return raw.astype(np.float32).reshape(shape)
    if dtype == "f8e4m3":
        return E4M3[raw].reshape(shape)
    if dtype in ("u4", "e2m1"):
        codes = unpack_nibbles(raw.reshape(*shape[:-1], -1), shape[-1])
        return (codes.astype(np.float32) if dtype == "u4" else E2M1[codes]).reshape(shape)
    bits = raw.astype(np.uint32) << 16
    return bits.view(np.float32).reshape(shape)


def dummy_weights(plan: dict, seed: int = 0) -> dict:
    """The CPU backend's weights for --load-format dummy: load_weights' structure (name -> array,
    or a list ordered like the weight's `layers`; tied weights share their target's)."""
    from .load import layers_of
    out, tied = {}, []
    roles = quant_roles(plan)
    for name, w in plan["weights"].items():
        if "tied" in w["source"]:
            tied.append((name, w["source"]["tied"]))
            continue
        if is_derived(w["source"]):        # the load program writes it: zeros until then
            arrays = [np.zeros(w["shape"], np.float32) for _ in layers_of(w)]
        else:
            arrays = [weight_values(name, w, layer, seed, roles.get(name)) for layer in layers_of(w)]
        out[name] = arrays[0] if w["layers"] is None else arrays
    for name, target in tied:
        out[name] = out[target]
    return out
