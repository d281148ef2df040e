"""rope(x[T, heads, D], theta, scaling=None, rotary_dim=None, interleaved=None) -> x rotated by its
token's position.

On the first R = rotary_dim dims of each head (HF's partial_rotary_factor; R = D when neither says
otherwise); dims R..D-1 pass through unchanged. Frequency j (j < R/2) rotates the pair (x1_j, x2_j)
to (x1_j cos_j - x2_j sin_j, x2_j cos_j + x1_j sin_j), the pair being
    rotate-half (interleaved None/false; Llama, NeoX):  x1, x2 = x[:R/2], x[R/2:R]
    interleaved (true; GPT-J, Cohere):                  x1, x2 = x[0:R:2], x[1:R:2]
    (HF cohere's rotate_half with repeat_interleave'd cos/sin: out[2j], out[2j+1])
    cos, sin = f32(cos(a)) * A, f32(sin(a)) * A,   a_j = f32(position) * inv_freq_j   (fp32)
inv_freq_j = theta^(-2j/R) for j < R/2, then per `scaling["rope_type"]` (HF's modeling_rope_utils):
    default   as is (A = 1)
    linear    inv_freq / factor (= positions / factor)
    llama3    low frequencies / factor, a smooth blend between low_freq_factor and high_freq_factor
    yarn      blend of inv_freq (extrapolation) and inv_freq / factor (interpolation) by a linear
              ramp over the dims between the beta_fast / beta_slow correction dims (floored / ceiled
              unless truncate is false); A = attention_factor, else mscale-derived:
              get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim) when both are set,
              else get_mscale(factor), get_mscale(s, m) = 0.1 m ln(s) + 1 (1 for s <= 1)
Other rope types are refused. Angles come from each token's absolute position, never from a
fixed-size table. inv_freq is computed in float64 and rounded to float32 (HF computes it in
float32: the two agree to ~1 ulp); the angle, cos, sin and rotation are float32 as in HF.
"""
import math

import numpy as np

from .base import REQUIRED, expect, finite_number, op

SUPPORTED = ("default", "linear", "llama3", "yarn")


def rope_type(scaling) -> str:
    if scaling and "rope_type" not in scaling and "type" not in scaling \
            and any(isinstance(v, dict) for v in scaling.values()):
        raise ValueError(f"rope parameters nested per layer type ({', '.join(scaling)}): pass the "
                         f"dict of the layer's own type")
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind not in SUPPORTED:
        raise ValueError(f"unsupported rope_type '{kind}' (supported: {', '.join(SUPPORTED)})")
    return kind


def rotary_dims(head_dim: int, scaling=None, rotary_dim=None) -> int:
    """R: rotary_dim, else int(head_dim * scaling's partial_rotary_factor), else head_dim. A given
    rotary_dim wins: HF's factor is a fraction of its config's head_dim, which is not x's where x is
    only the rotated part (Mistral-Small-4's MLA: partial_rotary_factor = rope / (nope + rope) of
    the whole query head, x the [T, H, rope] part)."""
    factor = (scaling or {}).get("partial_rotary_factor")
    derived = int(head_dim * factor) if factor is not None else None
    r = rotary_dim if rotary_dim is not None else derived if derived is not None else head_dim
    if not (0 < r <= head_dim and r % 2 == 0):
        raise ValueError(f"rotary_dim {r} must be even and in 1..head_dim ({head_dim})")
    return r


# The scaling parameters each rope type reads, and what a value must be: HF computes with them
# unchecked, so a 0 or negative factor, theta <= 0 (NaN / infinite frequencies) or a string
# ('2' / 'x', a TypeError deep in numpy) would otherwise be silently wrong numbers or a traceback.
_POSITIVE = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings",
             "attention_factor")
_NUMBER = ("mscale", "mscale_all_dim", "beta_fast", "beta_slow")    # HF reads a beta of 0 as unset


def check_parameters(theta, scaling):
    """Refuse (ValueError naming the key) a theta or scaling parameter rope cannot compute with."""
    if not finite_number(theta) or theta <= 0:
        raise ValueError(f"theta (the config's rope_theta) must be a positive number, got {theta!r}")
    if scaling is None:
        return
    if not isinstance(scaling, dict):
        raise ValueError(f"scaling (the config's rope_scaling) must be an object of rope "
                         f"parameters or none, got {scaling!r}")
    kind = rope_type(scaling)
    for k in _POSITIVE + _NUMBER:
        v = scaling.get(k)
        if v is not None and (not finite_number(v) or (k in _POSITIVE and v <= 0)):
            need = "a positive number" if k in _POSITIVE else "a number"
            raise ValueError(f"rope_scaling's '{k}' must be {need}, got {v!r}")
    f = scaling.get("partial_rotary_factor")
    if f is not None and (not finite_number(f) or not 0 < f <= 1):
        raise ValueError(f"rope_scaling's 'partial_rotary_factor' must be a number in (0, 1], got {f!r}")
    if scaling.get("truncate") not in (None, True, False):
        raise ValueError(f"rope_scaling's 'truncate' must be true or false, got {scaling['truncate']!r}")
    if kind == "yarn" and theta == 1:         # its correction dims divide by log(theta)
        raise ValueError("rope_type 'yarn' needs theta (rope_theta) other than 1")


def _need(scaling, kind, *keys):
    for k in keys:
        if scaling.get(k) is None:
            raise ValueError(f"rope_type '{kind}' needs '{k}' in its scaling parameters")
    return [scaling[k] for k in keys]


def yarn_mscale(scaling) -> float:
    """yarn's attention_factor A (HF's _compute_yarn_parameters)."""
    (factor,) = _need(scaling, "yarn", "factor")
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])

    def get_mscale(scale, m=1):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
    return float(get_mscale(factor))


def yarn_range(dim: int, theta: float, scaling) -> tuple[float, float]:
    """yarn's ramp bounds (low, high) over the dim // 2 frequencies, as HF finds them."""
    (old_len,) = _need(scaling, "yarn", "original_max_position_embeddings")
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations):
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001            # HF's guard against a zero-width ramp
    return float(low), float(high)


def rope_parameters(dim: int, theta: float, scaling=None) -> tuple[np.ndarray, float]:
    """(inv_freq f32 [dim // 2], attention factor A) for a rotary dim of `dim`."""
    kind = rope_type(scaling)
    freq = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    attention = 1.0
    if kind == "linear":
        (factor,) = _need(scaling, kind, "factor")
        freq = freq / factor
    elif kind == "llama3":
        factor, low, high, old_len = _need(scaling, kind, "factor", "low_freq_factor", "high_freq_factor",
                                           "original_max_position_embeddings")
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / freq
        freq = np.where(wavelen > low_wavelen, freq / factor, freq)
        if high != low:             # Llama-4 Scout's 1.0 / 1.0: no blend band
            smooth = (old_len / wavelen - low) / (high - low)
            mid = (1 - smooth) * freq / factor + smooth * freq
            freq = np.where((wavelen >= high_wavelen) & (wavelen <= low_wavelen), mid, freq)
    elif kind == "yarn":
        (factor,) = _need(scaling, kind, "factor")
        lo, hi = yarn_range(dim, theta, scaling)
        extrapolation = 1 - np.clip((np.arange(dim // 2, dtype=np.float64) - lo) / (hi - lo), 0, 1)
        freq = (freq / factor) * (1 - extrapolation) + freq * extrapolation
        attention = yarn_mscale(scaling)
    return freq.astype(np.float32), attention


def inv_freq(dim: int, theta: float, scaling) -> np.ndarray:
    return rope_parameters(dim, theta, scaling)[0]


def rotate(x, positions, theta, scaling=None, rotary_dim=None, interleaved=None):
    """x[T, heads, D] rotated at positions[T] (float32)."""
    d = x.shape[-1]
    r = rotary_dims(d, scaling, rotary_dim)
    freq, attention = rope_parameters(r, theta, scaling)
    ang = np.asarray(positions).astype(np.float32)[:, None] * freq[None, :]
    cos = (np.cos(ang) * np.float32(attention))[:, None, :]
    sin = (np.sin(ang) * np.float32(attention))[:, None, :]
    x = np.asarray(x, np.float32)
    if interleaved:
        x1, x2 = x[..., 0:r:2], x[..., 1:r:2]
        pairs = np.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
        return np.concatenate([pairs.reshape(*x.shape[:-1], r), x[..., r:]], axis=-1)
    x1, x2 = x[..., : r // 2], x[..., r // 2: r]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., r:]], axis=-1)


# The rotary dim the check computes inv_freq at. Its errors (a missing key, a domain error) and
# its range of values do not depend on the dim (more dims sample the same curve more finely), and
# a config's head_dim may be anything up to 2**31: an array of head_dim / 2 floats per rope node
# (GBs, minutes) is not how to refuse or accept it.
CHECK_DIM = 128


def check(head_dim, attrs):
    """Refuse an unsupported rope (a ShapeError naming it) at type inference."""
    try:
        scaling = attrs.get("scaling")
        check_parameters(attrs["theta"], scaling)
        rd = attrs.get("rotary_dim")
        if rd is not None and (isinstance(rd, bool) or not isinstance(rd, int)):
            raise ValueError(f"rotary_dim must be an integer, got {rd!r}")
        r = rotary_dims(head_dim, scaling, rd)
        freq, _ = rope_parameters(min(r, CHECK_DIM), attrs["theta"], scaling)
        if not np.isfinite(freq).all():
            raise ValueError(f"theta {attrs['theta']!r} with scaling {scaling!r} gives non-finite "
                             f"rotary frequencies")
        if attrs.get("interleaved") not in (None, True, False):
            raise ValueError(f"interleaved must be true or false, got {attrs['interleaved']!r}")
    except ValueError as e:
        expect(False, str(e))


def infer(types, attrs):
    (x,) = types
    expect(len(x.shape) == 3, f"rope expects x[T, heads, D], got {x}")
    check(x.shape[2], attrs)
    return [x]


def reference(ctx, x, theta, scaling=None, rotary_dim=None, interleaved=None):
    return rotate(x, ctx.positions, theta, scaling, rotary_dim, interleaved)


# interleaved defaults to None (not false) so that a rotate-half rope still fuses into
# qk_norm_rope_cache, which does not declare it (fuse_qk_norm_rope_cache skips a rope with an
# undeclared attribute that is not None)
op(name="rope", tensors=["x"],
   attrs={"theta": REQUIRED, "scaling": None, "rotary_dim": None, "interleaved": None},
   infer=infer, reference=reference, templates={"triton": "rope"}, strided=True,
   doc="rotary position embedding (rotate-half or interleaved pairs; partial rotary; "
       "default/linear/llama3/yarn)")
