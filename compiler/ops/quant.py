"""The numpy definition of a quantized linear's operands (compiler/quant/scheme.py): the oracle
that every quantized kernel and every format reader is tested against.

A linear-family op (linear, linear_act_mul, linear_gated) whose node carries attrs["quant"] reads
W as codes and, after its bias, the scheme's companions (w_scale, [w_zero], [w_gidx], [x_scale]).
The expert ops (moe_gate_up, moe_down) read a stack of E experts' codes [E, N, K] the same way,
their companions after moe_align's rows and counts, each with a leading E axis.
Its reference dequantizes W exactly and quantizes the activations as the format does, then runs
the bf16 op's own math in float32.
A linear or linear_gated whose activations a quantize_act launch made (attrs["has_a_scale"]:
compiler/passes/quantize_activations.py) reads x as the e4m3 codes and, last, their scales
a_scale [rows, groups]: codes * scale is the quantizer's output bit for bit (act_codes below).
"""
import numpy as np

from ..quant.scheme import COMPANIONS, FP8_MAX, QuantScheme
from .base import expect

# the optional inputs a linear-family op declares after its bias
QUANT_OPTIONAL = list(COMPANIONS)
# ... and, for the ops that can read ready activation codes, their scales after the companions
CODES_OPTIONAL = QUANT_OPTIONAL + ["a_scale"]


def scheme_of(attrs: dict) -> QuantScheme | None:
    q = attrs.get("quant")
    return None if q is None else QuantScheme.from_attrs(q)


def check_types(types, attrs, first: int, who: str, w_at: int = 1):
    """The companions' shapes and dtypes (types[first:] are the inputs after W and the bias;
    types[w_at] is W, [N, K] or a stack of experts [E, N, K] whose companions lead with E)."""
    s = scheme_of(attrs)
    if s is None:
        expect(not any(attrs.get("has_" + c) for c in COMPANIONS), f"{who}: quantization inputs without attrs.quant")
        return
    w = types[w_at]
    n, k = w.shape[-2:]
    expect(w.dtype == s.codes, f"{who}: weight {w} must hold {s.codes} codes for scheme {s}")
    expect(s.bits == 8 or k % 2 == 0, f"{who}: {s.codes} codes pack two a byte along K; K = {k} is odd")
    names = s.companions()
    expect([c for c in COMPANIONS if attrs.get("has_" + c)] == names,
           f"{who}: scheme {s} needs inputs {names}")
    got = dict(zip(names, types[first:]))
    lead = tuple(w.shape[:-2])
    for c in ("w_scale", "w_zero"):
        if c in got:
            t = got[c]
            expect(t.dtype == "f32" and tuple(t.shape[:-2]) == lead and t.shape[-2] == -(-n // s.block_n)
                   and (s.g_idx or t.shape[-1] == s.groups(k)),
                   f"{who}: {c} must be f32 [{', '.join(map(str, lead + (-(-n // s.block_n),)))}, "
                   f"{s.groups(k)}], got {t}")
    if "w_gidx" in got:
        expect(got["w_gidx"].dtype == "i32" and got["w_gidx"].shape == lead + (k,),
               f"{who}: w_gidx must be i32 [{k}], got {got['w_gidx']}")
    if "x_scale" in got:
        expect(got["x_scale"].dtype == "f32" and got["x_scale"].shape == (1,),
               f"{who}: x_scale must be f32 [1], got {got['x_scale']}")
    x = types[0]
    if attrs.get("has_a_scale"):
        expect(reads_codes(s), f"{who}: ready activation codes need fp8 weights with quantized activations, "
                               f"not {s}")
        a_scale = types[first + len(names)]
        want = tuple(x.shape[:-1]) + (act_groups(s, k),)
        expect(x.dtype == "f8e4m3" and a_scale.dtype == "f32" and tuple(a_scale.shape) == want,
               f"{who}: ready activation codes are f8e4m3 x with f32 a_scale [{', '.join(map(str, want))}], "
               f"got {x} and {a_scale}")
    else:
        expect(x.dtype != "f8e4m3", f"{who}: an f8e4m3 input without its scales (attrs.has_a_scale)")


def round_e4m3(v: np.ndarray) -> np.ndarray:
    """v (float32) rounded to the nearest e4m3 value (ties to even), saturated at +-448: what a
    cast to float8_e4m3fn computes for the values an activation quantizer hands it."""
    v = np.asarray(v, np.float32)
    a = np.minimum(np.abs(v), FP8_MAX)
    # quantum: 2^(e - 3) for a normal of exponent e >= -6, else the subnormal step 2^-9
    e = np.floor(np.log2(np.maximum(a, np.float32(2.0 ** -6))))
    q = np.exp2(e - 3).astype(np.float32)
    return (np.sign(v) * np.minimum(np.round(a / q) * q, FP8_MAX)).astype(np.float32)


def reads_codes(s: QuantScheme | None) -> bool:
    """Whether a linear of scheme s can take its activations as ready e4m3 codes + scales: fp8
    weights whose activations the format quantizes, with one A scale a row a group (not act-order)."""
    return s is not None and s.codes == "f8e4m3" and s.act != "none" and not s.g_idx


def act_groups(s: QuantScheme, k: int) -> int:
    """Scales a row of quantized activations holds: one a group (dynamic_group), else one."""
    return -(-k // s.act_group) if s.act == "dynamic_group" else 1


def act_codes(x: np.ndarray, s: QuantScheme, x_scale=None):
    """(codes' values float32 [..., K], scales float32 [..., groups]) of x as the format's
    activation quantizer makes them: quantize_activations(x) == codes * scales (each group's)."""
    x = np.asarray(x, np.float32)
    k = x.shape[-1]
    if s.act == "static":
        scale = np.full(x.shape[:-1] + (1,), np.float32(x_scale.reshape(-1)[0]), np.float32)
        return round_e4m3(x / scale), scale
    g = k if s.act == "dynamic_token" else s.act_group
    pad = -k % g
    xp = np.concatenate([x, np.zeros(x.shape[:-1] + (pad,), np.float32)], -1) if pad else x
    xg = xp.reshape(x.shape[:-1] + (-1, g))
    amax = np.abs(xg).max(-1, keepdims=True)
    scale = np.where(amax > 0, amax / np.float32(FP8_MAX), np.float32(1.0)).astype(np.float32)
    codes = round_e4m3(xg / scale).reshape(xp.shape)[..., :k]
    return codes, scale[..., 0]


def from_codes(codes: np.ndarray, a_scale: np.ndarray, s: QuantScheme) -> np.ndarray:
    """The activations' values from ready codes and scales (act_codes' inverse, exact)."""
    codes = np.asarray(codes, np.float32)
    k = codes.shape[-1]
    cols = np.arange(k) // s.act_group if s.act == "dynamic_group" else np.zeros(k, np.int64)
    return (codes * np.asarray(a_scale, np.float32)[..., cols]).astype(np.float32)


def quantize_activations(x: np.ndarray, s: QuantScheme, x_scale=None) -> np.ndarray:
    """x as the format's activation quantizer leaves it (dequantized back to float32)."""
    if s.act == "none":
        return x
    x = np.asarray(x, np.float32)
    if s.act == "static":
        scale = np.float32(x_scale.reshape(-1)[0])
        return round_e4m3(x / scale) * scale
    k = x.shape[-1]
    g = k if s.act == "dynamic_token" else s.act_group
    pad = -k % g
    xp = np.concatenate([x, np.zeros(x.shape[:-1] + (pad,), np.float32)], -1) if pad else x
    xg = xp.reshape(x.shape[:-1] + (-1, g))
    amax = np.abs(xg).max(-1, keepdims=True)
    scale = np.where(amax > 0, amax / np.float32(FP8_MAX), np.float32(1.0)).astype(np.float32)
    out = round_e4m3(xg / scale) * scale
    return out.reshape(xp.shape)[..., :k]


def dequantize(codes: np.ndarray, s: QuantScheme, w_scale, w_zero=None, w_gidx=None) -> np.ndarray:
    """W from its codes' values (float32 [..., N, K]) and companions, by the definition."""
    n, k = codes.shape[-2:]
    cols = np.asarray(w_gidx, np.int64).reshape(-1)[:k] if w_gidx is not None else \
        (np.arange(k) // s.block_k if s.block_k else np.zeros(k, np.int64))
    rows = np.arange(n) // s.block_n
    expand = lambda t: np.asarray(t, np.float32)[..., rows, :][..., cols]   # noqa: E731
    zero = expand(w_zero) if w_zero is not None else np.float32(s.implied_zero())
    return ((np.asarray(codes, np.float32) - zero) * expand(w_scale)).astype(np.float32)


def operands(x, w, rest: tuple, attrs: dict):
    """(x, W, bias or None) of a linear-family reference: rest holds the optional arrays after W
    (the bias, then the scheme's companions)."""
    rest = list(rest)
    bias = rest.pop(0) if attrs.get("has_bias") else None
    s = scheme_of(attrs)
    if s is None:
        return x, w, bias
    got = dict(zip(s.companions(), rest))
    w = dequantize(w, s, got["w_scale"], got.get("w_zero"), got.get("w_gidx"))
    if attrs.get("has_a_scale"):
        return from_codes(x, rest[len(got)], s), w, bias
    return quantize_activations(x, s, got.get("x_scale")), w, bias


def expert_operands(x, w, rest: tuple, attrs: dict, upcast: bool = False):
    """(x, W) of an expert op's reference (moe_gate_up, moe_down): rest holds the scheme's
    companions of the stacked codes w [E, N, K], each with a leading E axis. upcast: W is the
    stack expert_upcast wrote this step (rest's last; ops/expert_upcast.py stack_written)."""
    s = scheme_of(attrs)
    if s is None:
        return x, w
    got = dict(zip(s.companions(), rest))
    if upcast:
        # dequantized once this step, as the kernels read it: a plan whose stack buffer is not
        # live here shows up in the reference's logits
        w = rest[-1]
    else:
        w = dequantize(w, s, got["w_scale"], got.get("w_zero"), got.get("w_gidx"))
    if attrs.get("has_a_scale"):          # ready codes: their scales follow the companions
        return from_codes(x, rest[len(got)], s), w
    return quantize_activations(x, s, got.get("x_scale")), w


def quant_attrs(attrs: dict) -> dict:
    """The quantization attributes a fusion carries from the linear it replaces."""
    return {k: v for k, v in attrs.items() if k == "quant" or k in {"has_" + c for c in CODES_OPTIONAL}}
