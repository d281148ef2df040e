"""The expert kernels' extra forms under the interpreter, against the ops' numpy references:
expert biases (moe_gate_up's [E, 2F] gate|up bias, moe_down's [E, H]) and the clamped SwiGLU
(GPT-OSS: (min(u, l) clamped below at -l, + 1) * g' sigmoid(alpha g'), g' = min(g, l)) and
act(g) * u for other activations (GeGLU, ReGLU experts), in the
decode kernels (CUDA-core and tensor-core paths) and the grouped prefill GEMMs (paired and two-dot
gate|up tiles). The limit is small enough that the clamps bite on most elements; test_moe_kernels.py
covers the plain SwiGLU forms and the shapes' edge cases (H=48, F=40, E=10: no block divides them).
"""
import numpy as np
import pytest
import torch

from infc.compiler.ops import REGISTRY

from exhaustive import EXHAUSTIVE

from .harness import poison, rand, rel_err, render, run
from .test_moe_kernels import E, F, H, TOL, down_inputs, f32, gate_up_inputs, grouping, named, routing, weights

CLAMPED = {"act": "clamped_swiglu", "alpha": 1.702, "limit": 0.8}
CLAMPED_SILU = {"act": "clamped_silu", "limit": 0.8}      # DeepSeek-V4's swiglu_limit form

# (template, phase, T, KT, ep, tune, attrs)
GATE_UP = [
    ("moe_gate_up", "decode", 1, 4, False, {}, CLAMPED),                                   # CUDA cores
    ("moe_gate_up", "decode", 3, 2, True, {"FMA_T": 2}, CLAMPED),                          # both paths
    ("moe_gate_up", "decode", 37, 4, False, {"BLOCK_T": 16, "TC": 16}, CLAMPED),           # tensor cores
    ("moe_gate_up", "decode", 3, 2, False, {}, {}),                                        # bias, SwiGLU
    ("moe_gate_up", "decode", 3, 2, False, {"FMA_T": 2}, CLAMPED_SILU),
    ("moe_gate_up_grouped", "prefill", 37, 4, False, {"BLOCK_M": 16, "BLOCK_F": 16, "BLOCK_K": 16}, CLAMPED),
    ("moe_gate_up_grouped", "prefill", 37, 2, True,
     {"BLOCK_M": 16, "BLOCK_F": 32, "BLOCK_K": 32, "PAIR": 0}, CLAMPED),
    pytest.param("moe_gate_up_grouped", "prefill", 37, 2, False, {"BLOCK_M": 16, "BLOCK_F": 16, "BLOCK_K": 16},
                 CLAMPED_SILU, marks=EXHAUSTIVE),     # the same _gated_act helper as the decode case's
    # act(g) * u with the config's hidden_act (GeGLU / tanh-GeGLU / ReGLU experts), HF spellings
    ("moe_gate_up", "decode", 3, 2, False, {"FMA_T": 2}, {"act": "gelu"}),
    ("moe_gate_up_grouped", "prefill", 37, 2, False, {"BLOCK_M": 16, "BLOCK_F": 16, "BLOCK_K": 16},
     {"act": "gelu_pytorch_tanh"}),
    pytest.param("moe_gate_up", "decode", 37, 4, False, {"BLOCK_T": 16, "TC": 16}, {"act": "relu"},
                 marks=EXHAUSTIVE),
]


@pytest.mark.parametrize("template,phase,T,KT,ep,tune,attrs", GATE_UP)
def test_moe_gate_up_bias_and_act(template, phase, T, KT, ep, tune, attrs):
    gen = np.random.default_rng(T * 10 + KT)
    ids, _ = routing(T, KT, E, gen, ep)
    rows, counts = grouping(ids, E, gen)
    x = rand((T, H), gen=gen)
    gu, _ = weights(E, H, F, gen)
    bias = rand((E, 2 * F), gen=gen, scale=0.5)
    ins, outs = gate_up_inputs(KT)
    attrs = {**attrs, "has_bias": True}
    k = render(template, "moe_gate_up", ins + [("bias", [E, 2 * F], "bf16", "weight")], outs,
               attrs=attrs, phase=phase, tune=tune)
    act = poison((T, KT, F))
    run(k, {"in:0": x, "in:1": ids, "in:2": gu, "in:3": rows, "in:4": counts, "in:5": bias, "out:0": act},
        {"T": T, "B": T if phase == "decode" else 1})
    ref = REGISTRY["moe_gate_up"].reference
    want = ref(None, f32(x), ids.numpy(), f32(gu), None, None, f32(bias), **attrs)
    assert rel_err(named(f32(act), ids), named(want, ids)) <= TOL
    # the bias and the activation each move the result far beyond the tolerance
    plain = ref(None, f32(x), ids.numpy(), f32(gu), None, None, f32(bias), has_bias=True)
    no_bias = ref(None, f32(x), ids.numpy(), f32(gu), **{a: v for a, v in attrs.items() if a != "has_bias"})
    assert rel_err(named(want, ids), named(no_bias, ids)) > 10 * TOL
    if attrs.get("act"):
        assert rel_err(named(want, ids), named(plain, ids)) > 10 * TOL


DOWN = [
    ("moe_down", "decode", 1, 4, False, {}),
    ("moe_down", "decode", 5, 4, True, {"FMA_T": 2, "BLOCK_H": 16}),
    ("moe_down", "decode", 37, 4, False, {"BLOCK_T": 16, "TC": 16, "BLOCK_H": 16}),
    ("moe_down_grouped", "prefill", 37, 4, False, {"BLOCK_M": 16, "BLOCK_H": 16, "BLOCK_K": 16}),
    ("moe_down_grouped", "prefill", 37, 2, True, {"BLOCK_M": 32, "BLOCK_H": 32, "BLOCK_K": 32}),
]


@pytest.mark.parametrize("template,phase,T,KT,ep,tune", DOWN)
def test_moe_down_bias(template, phase, T, KT, ep, tune):
    gen = np.random.default_rng(T * 10 + KT + 3)
    ids, rw = routing(T, KT, E, gen, ep)
    rows, counts = grouping(ids, E, gen)
    act = rand((T, KT, F), gen=gen, scale=0.5)
    _, down = weights(E, H, F, gen)
    bias = rand((E, H), gen=gen, scale=0.5)
    ins, outs = down_inputs(KT)
    k = render(template, "moe_down", ins + [("bias", [E, H], "bf16", "weight")], outs,
               attrs={"has_bias": True}, phase=phase, tune=tune)
    y = poison((T, H))
    run(k, {"in:0": act, "in:1": rw, "in:2": ids, "in:3": down, "in:4": rows, "in:5": counts,
            "in:6": bias, "out:0": y}, {"T": T, "B": T if phase == "decode" else 1})
    ref = REGISTRY["moe_down"].reference
    want = ref(None, f32(act), rw.numpy(), ids.numpy(), f32(down), None, None, f32(bias), has_bias=True)
    assert rel_err(f32(y), want) <= TOL
    assert rel_err(ref(None, f32(act), rw.numpy(), ids.numpy(), f32(down)), want) > 10 * TOL


def test_clamped_swiglu_reference():
    """The reference against the formula transformers' GptOssExperts._apply_gate writes, on the
    interleaved pair it reads (gate the even, up the odd columns), with values on both sides of
    the limits."""
    from infc.compiler.ops.gated_act import gated
    gate_up = torch.from_numpy(np.random.default_rng(0).standard_normal((5, 2 * 7)).astype(np.float32) * 9)
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    g = gate.clamp(min=None, max=7.0)
    u = up.clamp(min=-7.0, max=7.0)
    want = ((u + 1) * (g * torch.sigmoid(g * 1.702))).numpy()
    assert (np.abs(gate.numpy()) > 7).any() and (np.abs(up.numpy()) > 7).any()
    assert np.allclose(gated(gate.numpy(), up.numpy(), "clamped_swiglu", 1.702, 7.0), want, rtol=1e-6, atol=1e-6)
