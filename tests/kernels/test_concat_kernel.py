"""concat (compiler/ops/concat.py, issue 13: MLA's [q_lat | q_pe] and [c_kv | k_pe]) under the
interpreter against its numpy reference: 2-D and 3-D, widths not powers of two, small blocks."""
import numpy as np
import pytest

from infc.compiler.ops import REGISTRY

from .harness import poison, rand, render, run


@pytest.mark.parametrize("lead,NA,NB,block", [((5,), 512, 64, 1024), ((3, 4), 40, 8, 16), ((1, 2), 7, 5, 1024)])
def test_concat(lead, NA, NB, block):
    gen = np.random.default_rng(NA)
    a, b = rand((*lead, NA), gen=gen), rand((*lead, NB), gen=gen)
    shape = ["T", *lead[1:]]
    k = render("concat", "concat", [("a", [*shape, NA], "bf16"), ("b", [*shape, NB], "bf16")],
               [("y", [*shape, NA + NB], "bf16")], tune={"BLOCK": block})
    out = poison((*lead, NA + NB))
    run(k, {"in:0": a, "in:1": b, "out:0": out}, {"T": lead[0], "B": 1})
    want = REGISTRY["concat"].reference(None, a.float().numpy(), b.float().numpy())
    assert np.array_equal(out.float().numpy(), want)
