"""lora_shrink and lora_expand (codegen_templates/triton/lora_*.py.j2) under the interpreter,
against their numpy references (compiler/ops/lora.py): any mix of adapter slots and slot 0 in a
step in random order (the kernels take it grouped by slot: runtime/lora/groups.py), ragged T (1
among them) and widths that are no multiple of the tiles, ranks 8..256, bf16; the shrink's split-K
partials (ragged and empty K ranges, a prefill writing fewer splits than the buffer holds) summed
into split 0, the one split the expand reads."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from infc.compiler.ops import REGISTRY
from infc.runtime.lora.groups import lora_groups

from exhaustive import EXHAUSTIVE
from .harness import bf16, poison, rand, rel_err, render, run


def _ctx(slots):
    return SimpleNamespace(meta=SimpleNamespace(lora_slots=slots))


def _meta(slots, S):
    """The step metadata bindings the kernels read: the rows grouped by slot."""
    rows, segs = lora_groups(slots.numpy(), S)
    return {"meta:lora_rows": torch.from_numpy(rows), "meta:lora_segs": torch.from_numpy(segs)}


def _slots(gen, T, S):
    s = gen.integers(0, S, T).astype(np.int32)
    s[: min(T, 3)] = 0                          # rows without an adapter among them
    s[T // 2:T // 2 + 9] = S - 1                # a run of one adapter (a prefill's rows)
    return torch.from_numpy(s)


# (phase, T, K, S, P, R, split, prefill_split): K ranges ragged (200 / 3) or empty at the end (96 / 5:
# ranges of 32), T = 1 (a batch-1 step), a prefill of fewer splits than the buffer holds
SHRINK = [("decode", 37, 200, 5, 3, 8, 3, 3), ("decode", 45, 160, 5, 2, 64, 3, 3), ("decode", 1, 96, 4, 2, 16, 5, 5), ("prefill", 70, 96, 3, 1, 24, 4, 2),
          pytest.param("prefill", 9, 64, 2, 1, 256, 1, 1, marks=EXHAUSTIVE),
          pytest.param("decode", 130, 320, 9, 2, 16, 7, 4, marks=EXHAUSTIVE)]


def _used(phase, split, prefill_split):
    return split if phase == "decode" else prefill_split


@pytest.mark.parametrize("phase,T,K,S,P,R,split,pre", SHRINK)
def test_lora_shrink(phase, T, K, S, P, R, split, pre):
    gen = np.random.default_rng(T + K)
    x, a = rand((T, K), gen=gen), rand((S, P * R, K), scale=0.2, gen=gen)
    a[0] = 0                                    # slot 0: no adapter
    slots = _slots(gen, T, S) if T > 1 else torch.tensor([S - 1], dtype=torch.int32)
    attrs = {"split": split, "prefill_split": pre}
    k = render("lora_shrink", "lora_shrink", [("x", ["T", K], "bf16"), ("a", [S, P * R, K], "bf16", "weight")],
               [("xa", ["T", split * P * R], "f32")], attrs=attrs, phase=phase)
    used = _used(phase, split, pre)
    out = poison((T, split * P * R), "f32")
    run(k, {"in:0": x, "in:1": a, "out:0": out, **_meta(slots, S)}, {"T": T, "B": 1})
    parts = out.numpy().reshape(T, split, P * R)
    assert np.isnan(parts[:, used:]).all()      # this phase's splits alone are written
    want = REGISTRY["lora_shrink"].reference(_ctx(slots.numpy()), x.float().numpy(), a.float().numpy(), **attrs)
    want = want.reshape(T, split, P * R)[:, 0]
    got = parts[:, 0]                           # the partials' sum, the one split the expand reads
    assert np.array_equal(got[slots.numpy() == 0], np.zeros(((slots == 0).sum().item(), P * R)))
    assert rel_err(got, want) < 1e-5
    if T > 1 and used > 1:                      # the other K ranges parked their partials
        assert all(np.abs(parts[slots.numpy() != 0, z]).max() > 0 for z in range(1, min(used, -(-K // 16))))


# (phase, T, pieces, S, R, split, prefill_split)
EXPAND = [("decode", 37, [40, 24, 24], 5, 8, 3, 3), ("decode", 45, [72, 40], 5, 64, 4, 4), ("prefill", 70, [100], 3, 24, 4, 2),
          ("decode", 1, [72, 72], 4, 16, 6, 6), ("prefill", 21, [72, 72], 4, 16, 1, 1),
          pytest.param("decode", 6, [50, 30], 2, 256, 2, 2, marks=EXHAUSTIVE),
          pytest.param("prefill", 130, [130, 66, 66], 9, 64, 5, 3, marks=EXHAUSTIVE)]


@pytest.mark.parametrize("phase,T,pieces,S,R,split,pre", EXPAND)
def test_lora_expand(phase, T, pieces, S, R, split, pre):
    gen = np.random.default_rng(T + R)
    N, P = sum(pieces), len(pieces)
    y, xa = rand((T, N), gen=gen), rand((T, split, P * R), "f32", gen=gen)
    xa[:, 1:] = float("nan")                    # the shrink's partials: split 0 holds their sum
    b = rand((S, N, R), scale=0.2, gen=gen)
    scale = torch.from_numpy(gen.uniform(0.5, 2.0, (S, P)).astype(np.float32))
    b[0], scale[0] = 0, 0
    slots = _slots(gen, T, S) if T > 1 else torch.tensor([S - 1], dtype=torch.int32)
    attrs = {"pieces": pieces, "rank": R, "split": split, "prefill_split": pre}
    k = render("lora_expand", "lora_expand",
               [("y", ["T", N], "bf16"), ("xa", ["T", split * P * R], "f32"), ("b", [S, N, R], "bf16", "weight"),
                ("scale", [S, P], "f32", "weight")], [("y", ["T", N], "bf16")], attrs=attrs, phase=phase)
    before = y.clone()
    run(k, {"in:0": y, "out:0": y, "in:1": xa.reshape(T, -1), "in:2": b, "in:3": scale, **_meta(slots, S)},
        {"T": T, "B": 1})                       # in place: out is y's memory, as the plan lays it out
    # the kernel rounds the sum to bf16 (PEFT's lora_A output), so the reference gets it rounded too
    xs = xa.numpy()[:, 0]
    want = REGISTRY["lora_expand"].reference(_ctx(slots.numpy()), before.float().numpy(), bf16(xs),
                                             b.float().numpy(), scale.numpy(), pieces=pieces, rank=R,
                                             split=1, prefill_split=1)
    assert torch.equal(y[slots == 0], before[slots == 0])        # no adapter: rows untouched
    assert rel_err(y.float().numpy(), bf16(want)) < 1e-2
    delta = y.float().numpy() - before.float().numpy()
    hit = slots.numpy() != 0
    assert rel_err(delta[hit], (want - before.float().numpy())[hit]) < 3e-2


# (phase, T, F, S, R, split, prefill_split, fn)
EXPAND_ACT = [("decode", 1, 40, 3, 16, 4, 4, "silu"), ("prefill", 45, 70, 4, 8, 3, 2, "silu"),
              pytest.param("decode", 37, 100, 5, 24, 5, 5, "gelu_tanh", marks=EXHAUSTIVE)]


@pytest.mark.parametrize("phase,T,F,S,R,split,pre,fn", EXPAND_ACT)
def test_lora_expand_act_is_the_expand_then_the_activation(phase, T, F, S, R, split, pre, fn):
    """The fused gate|up expand + activation against the reference and, bit for bit, against the
    two launches it replaces (lora_expand, then act_mul), slot 0 rows included."""
    gen = np.random.default_rng(T + F)
    y, xa = rand((T, 2 * F), gen=gen), rand((T, split, 2 * R), "f32", gen=gen)
    xa[:, 1:] = float("nan")
    b = rand((S, 2 * F, R), scale=0.2, gen=gen)
    scale = torch.from_numpy(gen.uniform(0.5, 2.0, (S, 2)).astype(np.float32))
    b[0], scale[0] = 0, 0
    slots = _slots(gen, T, S) if T > 1 else torch.tensor([S - 1], dtype=torch.int32)
    attrs = {"pieces": [F, F], "rank": R, "split": split, "prefill_split": pre}
    ins = [("y", ["T", 2 * F], "bf16"), ("xa", ["T", split * 2 * R], "f32"), ("b", [S, 2 * F, R], "bf16", "weight"),
           ("scale", [S, 2], "f32", "weight")]
    bind = {"in:1": xa.reshape(T, -1), "in:2": b, "in:3": scale, **_meta(slots, S)}
    fused = render("lora_expand_act", "lora_expand_act", ins, [("act", ["T", F], "bf16")],
                   attrs={**attrs, "fn": fn}, phase=phase)
    got = poison((T, F))
    run(fused, {**bind, "in:0": y, "out:0": got}, {"T": T, "B": 1})
    two = y.clone()
    run(render("lora_expand", "lora_expand", ins, [("y", ["T", 2 * F], "bf16")], attrs=attrs, phase=phase),
        {**bind, "in:0": two, "out:0": two}, {"T": T, "B": 1})
    want_bits = poison((T, F))
    run(render("act_mul", "act_mul", [("gu", ["T", 2 * F], "bf16")], [("act", ["T", F], "bf16")],
               attrs={"fn": fn}, phase=phase), {"in:0": two, "out:0": want_bits}, {"T": T, "B": 1})
    assert torch.equal(got, want_bits)
    xs = bf16(xa.numpy()[:, 0])
    want = REGISTRY["lora_expand_act"].reference(_ctx(slots.numpy()), y.float().numpy(), xs, b.float().numpy(),
                                                 scale.numpy(), pieces=[F, F], rank=R, split=1, prefill_split=1,
                                                 fn=fn)
    assert rel_err(got.float().numpy(), bf16(want)) < 2e-2


# (T, K, pieces, S, R, split, act): a narrow step's one row, and a few rows of 4 adapters + slot 0 (the
# merged launch holds up to 16: _lora_tiles.j2's MAX_ROWS); ragged K ranges, rank 64 among them
MERGED = [(1, 200, [40, 24, 24], 5, 16, 3, None), (13, 200, [72, 72], 5, 8, 4, "silu"),
          pytest.param(11, 160, [72, 40], 5, 64, 3, None, marks=EXHAUSTIVE),
          pytest.param(1, 96, [40, 40], 3, 16, 5, "gelu_tanh", marks=EXHAUSTIVE)]


@pytest.mark.parametrize("T,K,pieces,S,R,split,act", MERGED)
def test_a_merged_narrow_launch_is_the_shrink_then_the_expand_bit_for_bit(T, K, pieces, S, R, split, act):
    """lora_expand / lora_expand_act with the shrink merged in (compiler/passes/merge_prologues.py):
    the programs' roles in start order, the expand's waiting on the shrink's sum, give the two
    launches' output bit for bit, and leave their counters zero (the harness checks) so a graph
    replays them."""
    gen = np.random.default_rng(T + K + R)
    N, P = sum(pieces), len(pieces)
    x, a = rand((T, K), gen=gen), rand((S, P * R, K), scale=0.2, gen=gen)
    y, b = rand((T, N), gen=gen), rand((S, N, R), scale=0.2, gen=gen)
    scale = torch.from_numpy(gen.uniform(0.5, 2.0, (S, P)).astype(np.float32))
    a[0], b[0], scale[0] = 0, 0, 0
    slots = _slots(gen, T, S) if T > 1 else torch.tensor([S - 1], dtype=torch.int32)
    shrink_attrs = {"split": split, "prefill_split": split}
    attrs = {"pieces": pieces, "rank": R, **shrink_attrs, **({"fn": act} if act else {})}
    op, F = ("lora_expand_act", N // 2) if act else ("lora_expand", N)
    out_spec = [("act", ["T", F], "bf16")] if act else [("y", ["T", N], "bf16")]
    tables = [("b", [S, N, R], "bf16", "weight"), ("scale", [S, P], "f32", "weight")]
    xa_spec = ("xa", ["T", split * P * R], "f32")
    # the two launches
    xa = poison((T, split * P * R), "f32")
    run(render("lora_shrink", "lora_shrink", [("x", ["T", K], "bf16"), ("a", [S, P * R, K], "bf16", "weight")],
               [xa_spec], attrs=shrink_attrs), {"in:0": x, "in:1": a, "out:0": xa, **_meta(slots, S)}, {"T": T, "B": 1})
    want = y.clone() if not act else poison((T, F))
    run(render(op, op, [("y", ["T", N], "bf16"), xa_spec] + tables, out_spec, attrs=attrs),
        {"in:0": y, "out:0": want, "in:1": xa, "in:2": b, "in:3": scale, **_meta(slots, S)}, {"T": T, "B": 1})
    # the merged one: the shrink's inputs, then the expand's but xa
    prologue = {"op": "lora_shrink", "inputs": 2, "output": 0, "value": "xa", "writes": 0, "feeds": 1,
                "attrs": shrink_attrs}
    merged = render(op, op, [("x", ["T", K], "bf16"), ("a", [S, P * R, K], "bf16", "weight"),
                             ("y", ["T", N], "bf16")] + tables, out_spec, attrs=attrs, prologue=prologue, narrow=True)
    got = y.clone() if not act else poison((T, F))
    run(merged, {"in:0": x, "in:1": a, "in:2": y, "out:0": got, "in:3": b, "in:4": scale, **_meta(slots, S)},
        {"T": T, "B": 1})
    assert torch.equal(got, want)
    if not act:
        assert not torch.equal(got[slots != 0], y[slots != 0])        # the adapters added something
