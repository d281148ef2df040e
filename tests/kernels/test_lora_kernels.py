"""lora_shrink and lora_expand (codegen_templates/triton/lora_*.py.j2) under the interpreter,
against their numpy references (compiler/ops/lora.py): any mix of adapter slots and slot 0 in a
step, ragged T and widths that are no multiple of the tiles, ranks 8..256, bf16."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from infc.compiler.ops import REGISTRY

from exhaustive import EXHAUSTIVE
from .harness import bf16, poison, rand, rel_err, render, run


def _ctx(slots):
    return SimpleNamespace(meta=SimpleNamespace(lora_slots=slots))


def _slots(gen, T, S):
    s = gen.integers(0, S, T).astype(np.int32)
    s[: min(T, 3)] = 0                          # rows without an adapter among them
    s[T // 2:T // 2 + 9] = S - 1                # a run of one adapter (a prefill's rows)
    return torch.from_numpy(s)


SHRINK = [("decode", 37, 200, 5, 3, 8), ("prefill", 70, 96, 3, 1, 24),
          pytest.param("prefill", 9, 64, 2, 1, 256, marks=EXHAUSTIVE),
          pytest.param("decode", 130, 320, 9, 2, 16, marks=EXHAUSTIVE)]


@pytest.mark.parametrize("phase,T,K,S,P,R", SHRINK)
def test_lora_shrink(phase, T, K, S, P, R):
    gen = np.random.default_rng(T + K)
    x, a = rand((T, K), gen=gen), rand((S, P * R, K), scale=0.2, gen=gen)
    a[0] = 0                                    # slot 0: no adapter
    slots = _slots(gen, T, S)
    k = render("lora_shrink", "lora_shrink", [("x", ["T", K], "bf16"), ("a", [S, P * R, K], "bf16", "weight")],
               [("xa", ["T", P * R], "bf16")], phase=phase)
    out = poison((T, P * R))
    run(k, {"in:0": x, "in:1": a, "meta:lora_slots": slots, "out:0": out}, {"T": T, "B": 1})
    want = REGISTRY["lora_shrink"].reference(_ctx(slots.numpy()), x.float().numpy(), a.float().numpy())
    assert np.array_equal(out[slots == 0].float().numpy(), np.zeros(((slots == 0).sum().item(), P * R)))
    assert rel_err(out.float().numpy(), bf16(want)) < 1e-2


EXPAND = [("decode", 37, [40, 24, 24], 5, 8), ("prefill", 70, [100], 3, 24),
          ("prefill", 21, [72, 72], 4, 16),
          pytest.param("decode", 6, [50, 30], 2, 256, marks=EXHAUSTIVE),
          pytest.param("prefill", 130, [130, 66, 66], 9, 64, marks=EXHAUSTIVE)]


@pytest.mark.parametrize("phase,T,pieces,S,R", EXPAND)
def test_lora_expand(phase, T, pieces, S, R):
    gen = np.random.default_rng(T + R)
    N, P = sum(pieces), len(pieces)
    y, xa = rand((T, N), gen=gen), rand((T, P * R), gen=gen)
    b = rand((S, N, R), scale=0.2, gen=gen)
    scale = torch.from_numpy(gen.uniform(0.5, 2.0, (S, P)).astype(np.float32))
    b[0], scale[0] = 0, 0
    slots = _slots(gen, T, S)
    k = render("lora_expand", "lora_expand",
               [("y", ["T", N], "bf16"), ("xa", ["T", P * R], "bf16"), ("b", [S, N, R], "bf16", "weight"),
                ("scale", [S, P], "f32", "weight")], [("y", ["T", N], "bf16")],
               attrs={"pieces": pieces, "rank": R}, phase=phase)
    before = y.clone()
    run(k, {"in:0": y, "out:0": y, "in:1": xa, "in:2": b, "in:3": scale, "meta:lora_slots": slots},
        {"T": T, "B": 1})                       # in place: out is y's memory, as the plan lays it out
    want = REGISTRY["lora_expand"].reference(_ctx(slots.numpy()), before.float().numpy(), xa.float().numpy(),
                                             b.float().numpy(), scale.numpy(), pieces=pieces, rank=R)
    assert torch.equal(y[slots == 0], before[slots == 0])        # no adapter: rows untouched
    assert rel_err(y.float().numpy(), bf16(want)) < 1e-2
    delta = y.float().numpy() - before.float().numpy()
    assert rel_err(delta[slots != 0], (want - before.float().numpy())[slots != 0]) < 3e-2
