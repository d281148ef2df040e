"""fill_zero and embedding under the interpreter, against their numpy references."""
import numpy as np
import pytest
import torch

from infc.compiler.ops import REGISTRY

from .harness import poison, rand, render, run


@pytest.mark.parametrize("T,H", [(1, 64), (5, 2560), (37, 1000)])
def test_fill_zero(T, H):
    k = render("fill_zero", "fill_zero", [("x", ["T", H], "bf16")], [("d", ["T", H], "bf16")])
    out = poison((T, H))
    run(k, {"out:0": out}, {"T": T, "B": 1})
    assert torch.equal(out.float(), torch.zeros(T, H))


@pytest.mark.parametrize("T,V,H,block", [(1, 50, 64, 64), (7, 300, 1000, 256), (19, 1000, 576, 1024)])
def test_embedding(T, V, H, block):
    gen = np.random.default_rng(T)
    table = rand((V, H), gen=gen)
    ids = torch.from_numpy(gen.integers(0, V, T).astype(np.int32))
    k = render("embedding", "embedding", [("tokens", ["T"], "i32"), ("embed", [V, H], "bf16", "weight")],
               [("x", ["T", H], "bf16")], tune={"BLOCK": block})
    out = poison((T, H))
    run(k, {"in:0": ids, "in:1": table, "out:0": out}, {"T": T, "B": 1})
    want = REGISTRY["embedding"].reference(None, ids.numpy(), table.float().numpy())
    assert np.array_equal(out.float().numpy(), want)
