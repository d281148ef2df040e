"""Activation codes made once a step (compiler/passes/act_codes.py) under the interpreter: the
producers (quantize_act, add_rms_norm_quant) against compiler/ops/quant.py's act_codes bit for
bit, and the fp8 linears reading the ready codes (every GEMV path, the narrow codes path, the
GEMM's W8A8 form) against the same launch quantizing A itself: the outputs must be equal, bit for
bit (the pass must not move a model's logits). K = 136 is ragged against the groups of 64.
"""
import zlib

import numpy as np
import pytest
import torch

from infc.compiler.ops import REGISTRY
from infc.compiler.ops.quant import act_codes

from exhaustive import EXHAUSTIVE

from .harness import bf16, poison, rand, render, run
from .test_gemm_kernels import f32
from .test_gemv_prologue import EPS
from .test_quant_linear_kernels import GEMM_TUNES, GEMV_PATHS, K, N, NARROW_CODES, SCHEMES, _attrs, _specs, \
    _tensors, quantized_weight

ACTS = ["fp8-32x64-group64", "fp8-channel-token", "fp8-tensor-static"]


def _e4m3(values: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.asarray(values, np.float32)).to(torch.float8_e4m3fn)


def _same_codes(got: torch.Tensor, values: np.ndarray):
    """The kernel's codes are the oracle's values (a zero's sign aside: e4m3(-0.0) is the byte
    0x80, the oracle's np.sign makes it +0; either dots to the same sums). An unwritten code is
    0x7F, NaN."""
    assert np.array_equal(got.float().numpy(), np.asarray(values, np.float32))


def _x_scale(s):
    return np.array([2.5 / 448], np.float32) if s.act == "static" else None


@pytest.mark.parametrize("scheme", ACTS)
def test_quantize_act_is_the_definition(scheme):
    s = SCHEMES[scheme]
    gen = np.random.default_rng(zlib.crc32(scheme.encode()))
    T = 3
    x = rand((T, K), gen=gen, scale=1.5)
    x[1, 64:128] = 0                        # an all-zero group: its scale is 1
    ins = [("x", ["T", K], "bf16")] + ([("x_scale", [1], "f32", "weight")] if s.act == "static" else [])
    want_codes, want_scales = act_codes(f32(x), s, _x_scale(s))
    k = render("quantize_act", "quantize_act", ins, [("codes", ["T", K], "f8e4m3"),
                                                     ("a_scale", ["T", want_scales.shape[-1]], "f32")],
               attrs={"act_quant": s.attrs(), **({"has_x_scale": True} if s.act == "static" else {})})
    codes = torch.full((T, K), 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn)   # NaN: unwritten shows
    scales = poison(tuple(want_scales.shape), "f32")
    binds = {"in:0": x, "out:0": codes, "out:1": scales}
    if s.act == "static":
        binds["in:1"] = torch.from_numpy(_x_scale(s))
    run(k, binds, {"T": T, "B": 1})
    _same_codes(codes, want_codes)
    assert np.array_equal(scales.numpy(), want_scales)


@pytest.mark.parametrize("scheme", ACTS[:2])
def test_add_rms_norm_quant_writes_the_codes_of_its_h(scheme):
    """The residual and h as add_rms_norm writes them, and h's codes: the definition applied to
    the bf16 h it stored (what the linear after it quantized before the pass)."""
    s = SCHEMES[scheme]
    gen = np.random.default_rng(zlib.crc32(b"arn" + scheme.encode()))
    T = 3
    x, d, w = rand((T, K), gen=gen), rand((T, K), gen=gen, scale=0.5), rand((K,), gen=gen, scale=0.3)
    g = -(-K // s.act_group) if s.act == "dynamic_group" else 1
    ins = [("x", ["T", K], "bf16"), ("d", ["T", K], "bf16"), ("w", [K], "bf16", "weight")]
    outs = [("s", ["T", K], "bf16"), ("h", ["T", K], "bf16"), ("codes", ["T", K], "f8e4m3"), ("a_scale", ["T", g], "f32")]
    k = render("add_rms_norm", "add_rms_norm_quant", ins, outs, attrs={"eps": EPS, "act_quant": s.attrs()})
    res, h = poison((T, K)), poison((T, K))
    codes = torch.full((T, K), 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn)
    scales = poison((T, g), "f32")
    run(k, {"in:0": x, "in:1": d, "in:2": w, "out:0": res, "out:1": h, "out:2": codes, "out:3": scales}, {"T": T, "B": 1})
    r = bf16(f32(x) + f32(d))
    want_h = bf16(bf16(r / np.sqrt(np.mean(r * r, -1, keepdims=True) + EPS)) * f32(w))
    assert np.array_equal(f32(res), r) and np.abs(f32(h) - want_h).max() <= 2 ** -7 * np.abs(want_h).max()
    want_codes, want_scales = act_codes(f32(h), s)
    _same_codes(codes, want_codes)
    assert np.array_equal(scales.numpy(), want_scales)


def _linear(template, s, mode, T, tune, phase, seed, ready, narrow=False):
    """The launch's fp32 outputs on one random case, A quantized in the launch (ready False) or
    read as ready codes + scales (ready True)."""
    gen = np.random.default_rng(seed)
    op, w_mult = ("linear_gated", 2) if mode == "gated" else ("linear", 1)
    n_out = N // 2 if mode == "gated" else N
    w, _, comp = quantized_weight(s, n_out * w_mult, K, gen)
    x = rand((T, K), gen=gen, scale=1.5)
    attrs = _attrs(s, **({"fn": "silu"} if mode == "gated" else {}))
    stem = "_gated" if mode == "gated" else ""
    if ready:
        codes, scales = act_codes(f32(x), s, comp.get("x_scale"))
        ins = [("codes", ["T", K], "f8e4m3")] + [("w", [n_out * w_mult, K], s.codes, "weight")] + _specs(comp) \
            + [("a_scale", ["T", scales.shape[-1]], "f32")]
        arrays = [_e4m3(codes), w] + _tensors(comp) + [torch.from_numpy(scales)]
        attrs["has_a_scale"] = True
    else:
        ins = [("x", ["T", K], "bf16"), ("w", [n_out * w_mult, K], s.codes, "weight")] + _specs(comp)
        arrays = [x, w] + _tensors(comp)
    k = render(template + stem, op, ins, [("y", ["T", n_out], "f32")], attrs=attrs, phase=phase, tune=tune,
               narrow=narrow)
    y = poison((T, n_out), "f32")
    run(k, {f"in:{i}": a for i, a in enumerate(arrays)} | {"out:0": y}, {"T": T, "B": 1})
    return k, y.numpy()


def _equal(template, scheme, mode, T, tune, phase, narrow=False):
    seed = zlib.crc32(f"{template}{scheme}{mode}{T}{tune}".encode())
    k0, before = _linear(template, SCHEMES[scheme], mode, T, tune, phase, seed, False, narrow)
    k1, after = _linear(template, SCHEMES[scheme], mode, T, tune, phase, seed, True, narrow)
    assert "_a_codes(a" in k0.source and "_a_codes(a" not in k1.source.split("def _a_codes")[-1].split("\n\n\n", 1)[-1]
    assert np.isfinite(after).all() and np.array_equal(before, after)
    return k1


CASES = [  # (template, mode, T, tune, phase, narrow), the first of each kind fast
    ("gemv", "plain", *GEMV_PATHS["fma"], "decode", False),
    ("gemv", "gated", *GEMV_PATHS["dot"], "decode", False),
    ("gemv", "plain", 1, NARROW_CODES["split"], "decode", True),
    ("gemv", "gated", 1, NARROW_CODES["one"], "decode", True),
    ("gemm", "plain", 37, GEMM_TUNES["tiles"], "prefill", False),
    ("gemm", "gated", 37, GEMM_TUNES["split"], "prefill", False),
    ("gemv", "plain", *GEMV_PATHS["dot-split"], "decode", False),
    ("gemv", "plain", *GEMV_PATHS["fma-rows"], "decode", False),
]
FAST = {(0, "fp8-32x64-group64"), (1, "fp8-channel-token"), (2, "fp8-32x64-group64"), (3, "fp8-tensor-static"),
        (4, "fp8-32x64-group64"), (5, "fp8-channel-token")}


@pytest.mark.parametrize("case,scheme", [pytest.param(i, s, id=f"{CASES[i][0]}-{CASES[i][1]}-{i}-{s}",
                                                      marks=() if (i, s) in FAST else EXHAUSTIVE)
                                         for i in range(len(CASES)) for s in ACTS])
def test_linear_reading_ready_codes_is_bit_identical(case, scheme):
    template, mode, T, tune, phase, narrow = CASES[case]
    k = _equal(template, scheme, mode, T, tune, phase, narrow)
    if narrow:      # the narrow codes path, with no codes pass and no scratch of its own
        assert "tl.dot(raw, tl.trans(ac))" in k.source and "scratch:actq" not in [p[2] for p in k.meta["params"]]
