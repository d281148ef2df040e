"""rope_tail (DeepSeek-V4's RoPE on the last R dims of a head, interleaved pairs; inverse rotates
back): the Triton kernel under the interpreter against the numpy reference
(compiler/ops/compressed_attention.py, itself checked against transformers in
tests/test_deepseek_v4_attention.py). Random bf16 inputs, odd head counts, pass-through widths
and half-rotations that are not powers of two, YaRN with attention_factor 1 (V4's compressed
branches), a row-strided input, T not a multiple of the token block."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from infc.compiler.ops import REGISTRY
from tests.exhaustive import EXHAUSTIVE

from .harness import poison, rand, rel_err, render, run

YARN = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
        "beta_slow": 1, "attention_factor": 1.0, "partial_rotary_factor": 0.125}

CASES = [
    # heads, D, R, theta, scaling, inverse, row_stride, tune, phase, positions
    (3, 40, 12, 10000.0, None, False, None, {}, "prefill", [0, 1, 5, 17, 4095, 70000, 9]),
    (5, 24, 8, 160000.0, YARN, True, 5 * 24 + 8, {"BLOCK_H": 2, "BLOCK_T": 3}, "prefill", list(range(7)) + [90000]),
    (1, 64, 64, 10000.0, None, True, None, {}, "decode", [33, 0, 2047]),
]


@pytest.mark.parametrize("heads,d,r,theta,scaling,inverse,stride,tune,phase,positions",
                         CASES[:2] + [pytest.param(*CASES[2], marks=EXHAUSTIVE)])
def test_rope_tail_kernel(heads, d, r, theta, scaling, inverse, stride, tune, phase, positions):
    gen = np.random.default_rng(heads * 100 + d)
    attrs = {"theta": theta, "scaling": scaling, "rotary_dim": r, "inverse": inverse}
    extra = {"row_stride": stride} if stride else {}
    k = render("rope_tail", "rope_tail", [("x", ["T", heads, d], "bf16", "buffer", extra)],
               [("o", ["T", heads, d], "bf16")], attrs=attrs, phase=phase, tune=tune)
    T = len(positions)
    width = stride or heads * d
    wide = rand((T + 2, width), gen=gen, scale=2.0)
    x = wide[:T, : heads * d].reshape(T, heads, d)
    out_full = poison((T + 2, heads, d))
    out = out_full[:T]
    run(k, {"in:0": wide.view(-1), "out:0": out,
            "meta:positions": torch.tensor(positions, dtype=torch.int32)}, {"T": T, "B": 1})
    assert torch.isnan(out_full[T:].float()).all(), "wrote rows past T"
    xf = x.float().numpy()
    want = REGISTRY["rope_tail"].reference(SimpleNamespace(positions=np.asarray(positions, np.int64)), xf, **attrs)
    got = out.float().numpy()
    assert rel_err(got, want) <= 1e-2
    assert np.abs(got - want).max() <= 2 ** -7 * np.abs(want).max()
    assert np.array_equal(got[..., : d - r], xf[..., : d - r])          # the nope dims are a copy
    assert np.abs(got[..., d - r:] - xf[..., d - r:]).max() > 0.1        # and the tail did rotate
