"""capture_hidden (compiler/ops/capture_hidden.py: a speculation head's target hidden states)
under the interpreter against its numpy reference: the columns of the layer it runs at written
(a layer listed twice: both), none at another layer, the after-the-loop form; H not a multiple of
the block."""
import numpy as np
import pytest

from infc.compiler.ops import REGISTRY

from .harness import poison, rand, render, run


class _Ctx:
    def __init__(self, layer):
        self.layer = layer


@pytest.mark.parametrize("layer,outside,written", [(3, None, [0, 2]), (1, None, []), (None, 4, [3])])
def test_capture_hidden(layer, outside, written):
    T, H, layers = 5, 40, [3, 0, 3, 4]
    gen = np.random.default_rng(H)
    x = rand((T, H), gen=gen)
    aux = rand((T, len(layers) * H), gen=gen)
    before = aux.float().numpy().copy()
    k = render("capture_hidden", "capture_hidden", [("x", ["T", H], "bf16"), ("aux", ["T", len(layers) * H], "bf16")],
               [("aux", ["T", len(layers) * H], "bf16")], attrs={"layers": layers, "outside": outside},
               tune={"BLOCK": 16})
    want = REGISTRY["capture_hidden"].reference(_Ctx(layer), x.float().numpy(), before, layers, outside)
    expect = before.copy()
    for j in written:
        expect[:, j * H:(j + 1) * H] = x.float().numpy()
    assert np.array_equal(want, expect)
    run(k, {"in:0": x, "in:1": aux, "out:0": aux}, {"T": T, "B": 1}, layer=layer)
    assert np.array_equal(aux.float().numpy(), want)
