"""The narrow codes path's CUDA-core form (gemv.py.j2 FP8_FORM "fma": triton/_gemv_fp8_fma.j2)
under the interpreter: a narrow step's one row against e4m3 W with quantized activations, the
codes converted to fp32 and multiplied on CUDA cores, against compiler/ops/quant.py's definition
(random codes up to e4m3's 448, random scales; N = 40 and K = 136 ragged against the tiles, the
scales' row blocks and the activation groups of 64). A's codes made in the launch (each activation
quantizer; plain, gated and the merged add_rms_norm prologue; split-K), read ready (the act_codes
pass: bit for bit the launch that made them), and gate|up carrying down's codes in its epilogue.
"""
import zlib

import numpy as np
import pytest
import torch

from infc.compiler.codegen.render import TemplateError
from infc.compiler.ops.quant import act_codes

from exhaustive import EXHAUSTIVE

from . import test_quant_linear_kernels as tq
from .harness import rel_err, render
from . import test_gated_codes_epilogue as ge
from .test_act_codes_kernels import _equal, _same_codes

FMA = {"FP8_FORM": "fma"}
# (scheme, mode, tune): K steps of one group (64), of two (128: a step's runs meet two groups'
# scales), a K range a split, fewer rows than a warp holds
CASES = {
    "group64-plain": ("fp8-32x64-group64", "plain", {"BLOCK_N": 16, "FMA_BLOCK_K": 64}),
    "group64-gated-split": ("fp8-32x64-group64", "gated", {"BLOCK_N": 16, "FMA_BLOCK_K": 128, "SPLIT_K": 2}),
    "token-prologue-split": ("fp8-channel-token", "prologue", {"BLOCK_N": 16, "FMA_BLOCK_K": 64, "SPLIT_K": 2}),
    "static-plain": ("fp8-tensor-static", "plain", {"BLOCK_N": 8, "FMA_BLOCK_K": 64}),
    "group64-prologue": ("fp8-32x64-group64", "prologue", {"BLOCK_N": 32, "FMA_BLOCK_K": 128}),
    "token-gated": ("fp8-channel-token", "gated", {"BLOCK_N": 16, "FMA_BLOCK_K": 64}),
    "static-split": ("fp8-tensor-static", "plain", {"BLOCK_N": 16, "FMA_BLOCK_K": 64, "SPLIT_K": 3}),
}
FAST = {"group64-plain", "group64-gated-split", "token-prologue-split", "static-split", "token-gated"}


def _check(name, k_cols=None, monkeypatch=None):
    scheme, mode, tune = CASES[name]
    if k_cols is not None:
        monkeypatch.setattr(tq, "K", k_cols)
    k, got, want = tq._case("gemv", tq.SCHEMES[scheme], mode, 1, {**tune, **FMA}, "decode",
                            zlib.crc32(f"fp8fma{name}{k_cols}".encode()), narrow=True, out_dtype="f32")
    assert "_run_sums(" in k.source and "tl.dot(" not in k.source
    # exact products of codes, fp32 sums in another order than the oracle's (gated: bf16 roundings)
    assert rel_err(got, want) <= (tq.TOL if mode == "gated" else 2e-6)
    return k


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in FAST else EXHAUSTIVE) for n in CASES])
def test_fp8_fma_form_is_the_definition(name):
    _check(name)


def test_fp8_fma_form_unmasked_steps(monkeypatch):
    """K a multiple of the K step: the loop's code tiles load unmasked (K = 128, steps of 64), the
    first step masked: three splits of one step each leave the last an empty range at K, whose
    first step must read nothing (an unmasked one would read past W's last row)."""
    monkeypatch.setitem(CASES, "group64-split3", ("fp8-32x64-group64", "plain",
                                                  {"BLOCK_N": 16, "FMA_BLOCK_K": 64, "SPLIT_K": 3}))
    k = _check("group64-split3", 128, monkeypatch)
    assert "_fp8_tile(w3, k0, k_hi, FMA_BLOCK_K, False)" in k.source
    assert "_fp8_tile(w3, k_lo, k_hi, FMA_BLOCK_K, True)" in k.source


@pytest.mark.parametrize("scheme", ["fp8-32x64-group64", pytest.param("fp8-channel-token", marks=EXHAUSTIVE)])
def test_fp8_fma_form_reads_ready_codes(scheme):
    """Ready codes and scales (the act_codes pass) give the launch's own codes' output, bit for bit."""
    k = _equal("gemv", scheme, "plain", 1, {"BLOCK_N": 16, "FMA_BLOCK_K": 128, "SPLIT_K": 2, **FMA}, "decode",
               narrow=True)
    assert "_run_sums(" in k.source


def test_fp8_fma_form_gated_epilogue_writes_downs_codes():
    """gate|up with down's codes as its epilogue (merge_epilogues) on the fma form, split-K: the
    act it writes is the launch's without the epilogue, its codes and scales act_codes' of it."""
    tune = {"BLOCK_N": 16, "SPLIT_K": 2, "FMA_BLOCK_K": 64, **FMA}
    _, plain, _, _, _ = ge._launch(tune, False)
    k, act, codes, scales, scratch = ge._launch(tune, True)
    assert "_run_sums(" in k.source
    assert not torch.isnan(act.float()).any() and torch.equal(act, plain)
    want_codes, want_scales = act_codes(act.float().numpy(), ge.DOWN)
    _same_codes(codes, want_codes)
    assert np.array_equal(scales.numpy(), want_scales)
    assert int(scratch["counters_codes"].abs().sum()) == 0


def test_fp8_form_choice():
    """fma by default (faster in the model: bench/NOTES.md, issue 42), dot on request; an unknown
    form, or a K step that splits an activation group, fails the render naming the tunable."""
    scheme, mode, tune = CASES["group64-plain"]
    s = tq.SCHEMES[scheme]
    ins = [("x", ["T", 128], "bf16"), ("w", [64, 128], s.codes, "weight"), ("w_scale", [2, 2], "f32", "weight")]

    def source(t):
        return render("gemv", "linear", ins, [("y", ["T", 64], "bf16")], attrs=tq._attrs(s), tune=t, narrow=True).source
    dot = source({"FP8_FORM": "dot"})
    assert "tl.dot(raw, tl.trans(ac))" in dot and "_run_sums(" not in dot
    assert "_run_sums(" in source({}) and source({}) == source(FMA)
    with pytest.raises(TemplateError, match="FP8_FORM"):
        source({"FP8_FORM": "mma"})
    for bad in (96, 192):          # splits a group of 64; not a power of two (the tile's aranges)
        with pytest.raises(TemplateError, match="FMA_BLOCK_K"):
            source({**FMA, "FMA_BLOCK_K": bad})
