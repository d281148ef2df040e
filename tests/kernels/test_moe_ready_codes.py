"""The routed experts reading ready activation codes (compiler/passes/act_codes.py: the token rows'
codes made once a step, shared by every chosen expert; down's act rows by one quantize_act) under
the interpreter: moe_gate_up / moe_down (decode) and their grouped forms, given e4m3 codes and
their scales (attrs.has_a_scale) instead of bf16 rows.

Each case runs the launch twice on the same random experts and rows: quantizing A itself, and
reading the codes compiler/ops/quant.py's act_codes makes of the same rows. Where the ready path
still dequantizes A (code * scale: the grouped GEMMs, the CUDA-core decode path) the two outputs
must be equal bit for bit; where the decode tile is one activation group (the codes form) the
launch dots e4m3 with e4m3 on tensor cores, a different fp32 summation order, so it is checked
against the op's reference (ready codes: from_codes' values) to the MoE tolerance. H = 48 and
F = 40 are ragged against the groups of 32 and the tiles.
"""
import zlib

import numpy as np
import pytest
import torch

from infc.compiler.ops import REGISTRY
from infc.compiler.ops.quant import act_codes

from exhaustive import EXHAUSTIVE

from .harness import bf16, poison, rand, rel_err, render, run
from .test_moe_kernels import E, F, H, TOL, f32, grouping, named, routing, zero_counters
from .test_moe_quant_kernels import SCHEMES, _attrs, _specs, quantized_stack


def _e4m3(values: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.asarray(values, np.float32)).to(torch.float8_e4m3fn)


def _launch(launch, s, T, KT, template, tune, seed, ready, upcast=None):
    """(kernel, output float32, reference float32, ids) of one case; ready: A as codes + scales;
    upcast: the rows from which a grouped launch reads the stack dequantized once (its last
    input, the definition in bf16: compiler/passes/upcast_experts.py)."""
    gen = np.random.default_rng(seed)
    ids, rw = routing(T, KT, E, gen)
    gate_up = launch == "gate_up"
    n, k = (2 * F, H) if gate_up else (H, F)
    a = rand((T, H), gen=gen, scale=1.5) if gate_up else rand((T, KT, F), gen=gen, scale=0.5)
    w, values, comp = quantized_stack(s, n, k, gen)
    a_shape = ["T", H] if gate_up else ["T", KT, F]
    attrs = _attrs(s)
    lead = [("x", a_shape, "bf16")] if gate_up else [("act", a_shape, "bf16"), ("weights", ["T", KT], "f32")]
    ins = lead + [("ids", ["T", KT], "i32"), ("w", [E, n, k], s.codes, "weight"), ("rows", [E, "T"], "i32"),
                  ("counts", [E], "i32")] + _specs(comp)
    a_in, tail = a, []
    if ready:
        codes, scales = act_codes(f32(a), s)
        ins[0] = (ins[0][0], a_shape, "f8e4m3")
        ins.append(("a_scale", a_shape[:-1] + [scales.shape[-1]], "f32"))
        a_in, tail = _e4m3(codes), [scales]
        attrs = {**attrs, "has_a_scale": True}
    if upcast is not None:
        from infc.compiler.ops.quant import dequantize
        ins.append(("w_upcast", [E, n, k], "bf16"))
        tail = tail + [bf16(dequantize(values, s, comp["w_scale"], comp.get("w_zero")))]
        attrs = {**attrs, "has_w_upcast": True, "upcast_rows": upcast}
    out_shape = ("T", KT, F) if gate_up else ("T", H)
    phase = "decode" if template in ("moe_gate_up", "moe_down") else "prefill"
    kern = render(template, "moe_" + launch, ins, [("y", list(out_shape), "bf16")], attrs=attrs, phase=phase,
                  tune=tune)
    rows, counts = grouping(ids, E, gen)
    y = poison((T, KT, F) if gate_up else (T, H))
    arrays = [a_in] + ([] if gate_up else [rw]) + [ids, w, rows, counts] + \
        [torch.as_tensor(c) for c in comp.values()] + [torch.from_numpy(t) for t in tail]
    done = run(kern, {f"in:{i}": t for i, t in enumerate(arrays)} | {"out:0": y},
               {"T": T, "B": T if phase == "decode" else 1})
    if not gate_up:
        zero_counters(done)
    ref_a = f32(a) if not ready else codes
    ref_in = [ref_a] + ([] if gate_up else [rw.numpy()]) + [ids.numpy(), values, None, None]
    # (the reference reads the codes: a stack copy at the end of the inputs is the kernels' alone)
    want = REGISTRY["moe_" + launch].reference(None, *ref_in, *comp.values(), *tail, **attrs)
    got = f32(y)
    if gate_up:
        got, want = named(got, ids), named(want, ids)
    return kern, got, want


# (launch, template, T, KT, tune, codes form): batch 1's decode (T = 1, 8 experts: one token an
# expert) on the codes form; 7 tokens through the tensor-core path's dequantized form (BLOCK_K
# not the act group); one token on the CUDA-core path; the grouped GEMMs
CASES = {
    "gate_up-decode-codes": ("gate_up", "moe_gate_up", 1, 8, {"BLOCK_K": 32, "BLOCK_F": 16}, True),
    "down-decode-codes": ("down", "moe_down", 1, 8, {"BLOCK_K": 32, "BLOCK_H": 16}, True),
    "gate_up-decode-fma": ("gate_up", "moe_gate_up", 1, 8, {}, False),
    "down-decode-fma": ("down", "moe_down", 1, 8, {}, False),
    "gate_up-grouped": ("gate_up", "moe_gate_up_grouped", 37, 8, {"BLOCK_M": 16, "BLOCK_F": 16, "BLOCK_K": 32}, False),
    "down-grouped": ("down", "moe_down_grouped", 37, 8, {"BLOCK_M": 16, "BLOCK_H": 16, "BLOCK_K": 32}, False),
    "gate_up-decode-codes-7": ("gate_up", "moe_gate_up", 7, 2, {"BLOCK_K": 32, "TC": 16}, True),
    "down-decode-codes-7": ("down", "moe_down", 7, 2, {"BLOCK_K": 32, "TC": 16}, True),
    "gate_up-decode-dot-deq": ("gate_up", "moe_gate_up", 7, 2, {"FMA_T": 0, "BLOCK_K": 64, "TC": 16}, False),
}
# fast: the batch-1 codes form of gate_up and the CUDA-core form of down (test_published_blocks_take
# _the_codes_form runs down's codes form; tests/test_quant_moe.py the grouped GEMMs through a model)
FAST = {"gate_up-decode-codes", "down-decode-fma"}


@pytest.mark.parametrize("case", [pytest.param(c, marks=() if c in FAST else EXHAUSTIVE) for c in CASES])
def test_experts_reading_ready_codes(case):
    launch, template, T, KT, tune, codes_form = CASES[case]
    s = SCHEMES["fp8-8x32-group32"]
    seed = zlib.crc32(case.encode())
    k0, before, _ = _launch(launch, s, T, KT, template, tune, seed, False)
    k1, after, want = _launch(launch, s, T, KT, template, tune, seed, True)
    assert "_a_quant(" in k0.source and "as_ptr" not in k0.source
    # the ready launch makes no codes of its own: no amax, no division, no quantizer called
    assert "as_ptr" in k1.source and "_a_quant(" not in k1.source.split("@triton.jit\ndef moe_")[-1]
    assert np.isfinite(after).all() and rel_err(after, want) <= TOL
    if codes_form:
        assert "tl.dot(_w_raw(" in k1.source and k1.meta["constexprs"].get("FMA_T", 0) == 0
        assert rel_err(after, before) <= TOL
    else:
        assert "tl.dot(_w_raw(" not in k1.source
        np.testing.assert_array_equal(after, before)


def test_published_blocks_take_the_codes_form():
    """Qwen3-30B-A3B-FP8's 128 x 128 blocks with group-128 activations: the decode launches' K
    tiles are the act group (raised to 128), so batch 1 dots codes on tensor cores by default; a
    ragged single group (H = 48, F = 40 < 128) against the reference."""
    s = SCHEMES["fp8-128x128-group128"]
    for launch, template in (("gate_up", "moe_gate_up"), ("down", "moe_down")):
        kern, got, want = _launch(launch, s, 1, 8, template, {}, zlib.crc32(b"published" + launch.encode()), True)
        assert "tl.dot(_w_raw(" in kern.source and kern.meta["constexprs"]["BLOCK_K"] == 128
        assert np.isfinite(got).all() and rel_err(got, want) <= TOL


@pytest.mark.parametrize("case", [pytest.param(c, marks=() if c == "down-grouped" else EXHAUSTIVE)
                                  for c in ("gate_up-grouped", "down-grouped")])
def test_ready_codes_on_the_upcast_stack(case):
    """The grouped GEMMs reading ready codes and, in a step of at least upcast_rows rows, the
    experts' stack dequantized once: the bits of the same launch on the codes."""
    launch, template, T, KT, tune, _ = CASES[case]
    s = SCHEMES["fp8-8x32-group32"]
    seed = zlib.crc32(case.encode())
    _, on_codes, want = _launch(launch, s, T, KT, template, tune, seed, True)
    k, on_stack, _ = _launch(launch, s, T, KT, template, tune, seed, True, upcast=T)
    assert f"if T >= {T}:" in k.source and "as_ptr" in k.source
    np.testing.assert_array_equal(on_stack, on_codes)
    assert rel_err(on_stack, want) <= TOL
