"""Down's activation codes in the gated GEMV's epilogue (compiler/passes/merge_epilogues.py): a
one-token narrow step's fp8 gate|up launch on the codes path, reading ready codes, under the
interpreter. The launch with the quantize_act epilogue writes the same act, bit for bit, as the
launch without it, and codes / scales equal to compiler/ops/quant.py's act_codes of that bf16 act
(what the quantize_act launch it replaces makes). act columns 50 (N = 100 W rows) in groups of 16:
8 columns a program (BLOCK_N 16), two programs a group, the last group ragged (2 columns, one
program); unsplit and split-K (K = 136, ragged against gate|up's groups of 64)."""
import dataclasses
import zlib

import numpy as np
import pytest
import torch

from infc.compiler.codegen.render import TemplateError
from infc.compiler.ops.quant import act_codes

from .harness import poison, rand, render, run
from .test_act_codes_kernels import _e4m3, _same_codes
from .test_gemm_kernels import f32
from .test_quant_linear_kernels import SCHEMES, K, N, _attrs, _specs, _tensors, quantized_weight

GATE_UP = SCHEMES["fp8-32x64-group64"]
DOWN = dataclasses.replace(GATE_UP, act_group=16)     # down's activation groups: 16 act columns
F = N // 2


def _epilogue():
    return {"op": "quantize_act", "output": 0, "value": "act", "shape": ["T", F], "writes": 2,
            "attrs": {"act_quant": DOWN.attrs()}}


def _launch(tune, epilogue):
    gen = np.random.default_rng(zlib.crc32(repr(tune).encode()))
    w, _, comp = quantized_weight(GATE_UP, N, K, gen)
    x = rand((1, K), gen=gen, scale=1.5)
    codes, scales = act_codes(f32(x), GATE_UP)
    ins = [("codes", ["T", K], "f8e4m3"), ("w", [N, K], "f8e4m3", "weight")] + _specs(comp) \
        + [("a_scale", ["T", scales.shape[-1]], "f32")]
    outs = [("act", ["T", F], "bf16")]
    groups = -(-F // DOWN.act_group)
    if epilogue:
        outs += [("act_codes", ["T", F], "f8e4m3"), ("act_scale", ["T", groups], "f32")]
    k = render("gemv_gated", "linear_gated", ins, outs, attrs={**_attrs(GATE_UP, fn="silu"), "has_a_scale": True},
               tune=tune, narrow=True, epilogue=_epilogue() if epilogue else None)
    act = poison((1, F))
    got_codes = torch.full((1, F), 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn)   # NaN: unwritten shows
    got_scales = poison((1, groups), "f32")
    arrays = [_e4m3(codes), w] + _tensors(comp) + [torch.from_numpy(scales)]
    scratch = run(k, {f"in:{i}": a for i, a in enumerate(arrays)} | {"out:0": act, "out:1": got_codes,
                                                                      "out:2": got_scales}, {"T": 1, "B": 1})
    return k, act, got_codes, got_scales, scratch


# the dot form (the fma form's case: tests/kernels/test_fp8_fma_form.py)
@pytest.mark.parametrize("tune", [{"BLOCK_N": 16, "FP8_FORM": "dot"}, {"BLOCK_N": 16, "SPLIT_K": 2, "FP8_FORM": "dot"}],
                         ids=["one", "split"])
def test_gated_gemv_writes_downs_codes(tune):
    _, plain, _, _, _ = _launch(tune, False)
    k, act, codes, scales, scratch = _launch(tune, True)
    assert "tl.dot(raw, tl.trans(ac))" in k.source          # the narrow codes path
    assert not torch.isnan(act.float()).any() and torch.equal(act, plain)
    want_codes, want_scales = act_codes(act.float().numpy(), DOWN)
    _same_codes(codes, want_codes)
    assert np.array_equal(scales.numpy(), want_scales)
    assert int(scratch["counters_codes"].abs().sum()) == 0   # the group counters are left zero


def test_the_epilogue_needs_whole_programs_in_a_group():
    with pytest.raises(TemplateError, match="whole_programs"):
        _launch({"BLOCK_N": 64}, True)                     # 32 act columns a program, groups of 16
