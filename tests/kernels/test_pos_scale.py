"""pos_scale (compiler/ops/pos_scale.py): the reference against transformers' own factor
(get_llama_4_attn_scale, Mistral-Small-4's query scale), and the kernel under the interpreter
against the reference on random rows at positions that cross several floors (rows whose width is
not a multiple of the block). Its shift-1 form is Llama-4's attention temperature, checked against
Llama-4's formula in tests/kernels/test_attention_mods.py."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from infc.compiler.ir import TensorType
from infc.compiler.ops import REGISTRY, ShapeError
from infc.compiler.ops.pos_scale import factor

from .harness import poison, rand, render, run

POSITIONS = [0, 1, 3, 4, 5, 7, 8, 9, 15, 16, 17, 33, 100, 8191, 8192, 70000]


def test_factor_is_transformers_mistral4():
    from transformers.models.ministral3.modeling_ministral3 import get_llama_4_attn_scale
    pos = torch.tensor([POSITIONS])
    for beta, floor in ((0.1, 8192), (0.5, 4), (1.3, 3)):
        want = get_llama_4_attn_scale(pos, beta, floor).reshape(-1).numpy()
        np.testing.assert_allclose(factor(POSITIONS, floor, beta), want, rtol=1e-6)


@pytest.mark.parametrize("shape,tune", [(("T", 5, 24), None), (("T", 3, 40), {"BLOCK": 32}), (("T", 70), None)])
@pytest.mark.parametrize("shift", [0, 1])
def test_kernel_matches_reference(shape, tune, shift):
    attrs = {"floor": 4.0, "scale": 0.7, "shift": shift}
    k = render("pos_scale", "pos_scale", [("x", list(shape), "bf16")], [("o", list(shape), "bf16")],
               attrs=attrs, tune=tune)
    T = len(POSITIONS)
    x = rand((T,) + tuple(shape[1:]), gen=np.random.default_rng(len(shape)), scale=2.0)
    out = poison(tuple(x.shape))
    run(k, {"in:0": x, "out:0": out, "meta:positions": torch.tensor(POSITIONS, dtype=torch.int32)},
        {"T": T, "B": 1})
    want = REGISTRY["pos_scale"].reference(SimpleNamespace(positions=np.asarray(POSITIONS)), x.float().numpy(),
                                           **attrs)
    got = out.float().numpy()
    assert np.abs(got - want).max() <= 2 ** -7 * np.abs(want).max()
    assert not np.allclose(got, x.float().numpy())           # the factor is not 1 past the floor


@pytest.mark.parametrize("attrs,needle", [({"floor": 0, "scale": 0.1}, "floor must be a positive"),
                                          ({"floor": 8, "scale": "x"}, "scale must be a number"),
                                          ({"floor": 8, "scale": 0.1, "shift": -1}, "shift must be")])
def test_bad_attrs_are_named(attrs, needle):
    with pytest.raises(ShapeError, match=needle):
        REGISTRY["pos_scale"].infer([TensorType(("T", 4, 8), "bf16")], attrs)
