"""pos_embedding under the interpreter against its numpy reference: a random table, the
positions of a ragged step (a chunk continuing a cached prefix, a decode far into its sequence,
a fresh prefill), widths that are not multiples of the block."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from infc.compiler.ops import REGISTRY

from .harness import poison, rand, render, run

# (first position, new tokens) per sequence: a chunk after 9 cached tokens, a decode at 40,
# a prefill from 0
RAGGED = [(9, 7), (40, 1), (0, 5)]


def _positions(seqs):
    return np.concatenate([np.arange(s, s + n) for s, n in seqs]).astype(np.int32)


@pytest.mark.parametrize("P,H,block", [(64, 97, 1024), (48, 1000, 256), (41, 16, 1024)])
def test_pos_embedding(P, H, block):
    gen = np.random.default_rng(H)
    table = rand((P, H), gen=gen)
    pos = torch.from_numpy(_positions(RAGGED))
    T = pos.shape[0]
    k = render("pos_embedding", "pos_embedding", [("pos_embed", [P, H], "bf16", "weight")],
               [("p", ["T", H], "bf16")], tune={"BLOCK": block})
    out = poison((T, H))
    run(k, {"meta:positions": pos, "in:0": table, "out:0": out}, {"T": T, "B": len(RAGGED)})
    want = REGISTRY["pos_embedding"].reference(SimpleNamespace(positions=pos.numpy()), table.float().numpy())
    assert np.array_equal(out.float().numpy(), want)
    assert not np.array_equal(want[0], want[1])          # rows really differ per position


def test_reference_refuses_a_position_past_the_table():
    table = np.ones((8, 4), np.float32)
    with pytest.raises(ValueError, match="past the table"):
        REGISTRY["pos_embedding"].reference(SimpleNamespace(positions=np.array([3, 8])), table)
