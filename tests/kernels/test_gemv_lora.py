"""A narrow step's LoRA site in the GEMV's launch (compiler/passes/merge_lora.py,
codegen_templates/triton/gemv.py.j2 `lora`) under the interpreter against the references of the
launches it replaces (linear, lora_shrink, lora_expand / lora_expand_act, and add_rms_norm where
merged in front): one row (the CUDA-core path) and a few rows of several adapters and slot 0 (the
tensor-core path), widths and K not multiples of the tiles, K cut into ragged shrink ranges,
split-K, plain (q|k|v's three pieces) and gated (gate|up's two), the ranges taken by the GEMV's
programs (the interpreter's grid order) or by the shrink's own (the column axis reversed). The
sync words are left zero."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from infc.compiler.contract.bind import LORA_SET_COUNT, LORA_SET_WORDS, LORA_SETS
from infc.compiler.ops import REGISTRY

from exhaustive import EXHAUSTIVE

from .harness import bf16, poison, rand, rel_err, render, run

EPS = 1e-6
PROLOGUE = {"op": "add_rms_norm", "inputs": 3, "output": 1, "value": "h", "writes": 1, "attrs": {"eps": EPS}}


def _f(t):
    return t.float().numpy()


# (rows' slots, pieces, K, R, gated, prologue, tune): K = 200 in ranges of 64 (the last ragged),
# 130-wide column tiles of 32 / 64, split-K, slot 0 rows among adapters' rows; the shrink's schedule
# at its defaults (48 rank rows: 128-column ranges, two of them, a program each; the shrink's
# programs first in the grid, the waiters summing the ranges themselves) and at non-default ones
# (9 ranges of 64 over 3 programs, the delta's tables loaded before the W stream; a summing
# program and its ready flag; the shrink's programs after the GEMV's blocks; LORA_SETS 0: every
# program departs and the last zeroes the one set of words, left zero as the harness asserts;
# LORA_MID (the default): the look in the W stream, which in grid order finds every range arrived
# (the shrink's programs ran first) and in reversed order not for the first programs (their tail
# claims them); 0: the look at the tail only)
CASES = [
    ([3], [40, 36, 24], 200, 16, False, True, {}),
    ([1], [70, 70], 520, 16, True, False, {"LORA_KS": 64, "LORA_PROGRAMS": 3, "LORA_EARLY": 1}),
    ([3], [40, 36, 24], 200, 8, False, False, {"LORA_KS": 64, "BLOCK_N": 32, "FMA_BLOCK_K": 64}),
    ([2, 0, 3, 2, 1], [40, 36, 24], 200, 16, False, True, {"LORA_KS": 64, "SPLIT_K_DOT": 2, "BLOCK_K": 32}),
    ([1], [70, 70], 200, 16, True, True, {"LORA_KS": 64, "SPLIT_K": 2, "FMA_BLOCK_K": 64}),
    ([0, 3, 1], [40, 36, 24], 520, 16, False, True, {"LORA_KS": 64, "LORA_PROGRAMS": 3, "LORA_PARTS": 0, "LORA_SETS": 0}),
    ([2], [70, 70], 200, 16, True, False, {"LORA_KS": 64, "LORA_FIRST": 0, "LORA_PARTS": 0, "SPLIT_K": 2}),
    ([1, 0, 2], [70, 70], 200, 16, True, True, {"LORA_KS": 64, "LORA_SETS": 0}),
    ([3], [40, 36, 24], 520, 16, False, True, {"LORA_KS": 64, "FMA_BLOCK_K": 64}),
    ([0, 2, 1], [70, 70], 520, 16, True, False, {"LORA_KS": 128, "LORA_MID_AT": 2, "FMA_BLOCK_K": 64, "LORA_EARLY": 1}),
    ([2], [70, 70], 520, 16, True, True, {"LORA_KS": 64, "LORA_MID_AT": 3, "FMA_BLOCK_K": 64, "SPLIT_K": 2}),
    ([1, 3, 0], [40, 36, 24], 520, 16, False, False, {"LORA_KS": 64, "LORA_MID": 0, "FMA_BLOCK_K": 64}),
    pytest.param([2], [40, 36, 24], 200, 16, False, True, {"FMA_BLOCK_K": 64}, marks=EXHAUSTIVE),
    pytest.param([0, 2, 1], [70, 70], 136, 8, True, False, {"LORA_KS": 32}, marks=EXHAUSTIVE),
    pytest.param([0], [100], 200, 16, False, True, {"LORA_KS": 64}, marks=EXHAUSTIVE),
]


@pytest.fixture
def reversed_columns(monkeypatch):
    """The interpreter runs programs in grid order, so the GEMV's programs (column blocks first)
    would claim every shrink range before the shrink's own programs (past them) start: run the
    column axis backwards, the shrink's programs first, as a GPU may."""
    from triton.runtime import interpreter

    b = interpreter.interpreter_builder
    set_idx = type(b).set_grid_idx
    monkeypatch.setattr(type(b), "set_grid_idx", lambda self, x, y, z: set_idx(self, x, self.grid_dim[1] - 1 - y, z))


# A decode step's site (triton/_lora_rows.j2: every row on the tensor-core path, the shrink's items
# row blocks x K ranges, the delta per slot chunk): rows of four slots (slot 0 among them) in turn over several row
# blocks (16-row blocks: 37 rows are three, the last ragged), K ranges of 64 walked 32 (or 16) at a
# time, ragged K and pieces, split-K, the shrink's own programs few or many
CASES_ROWS = [
    ([i % 4 for i in range(37)], [40, 36, 24], 200, 16, False, {"BLOCK_T": 16, "LORA_KS": 64, "LORA_STEP": 32}),
    ([1, 0, 3, 2, 3, 1], [70, 70], 136, 8, True, {"LORA_KS": 32, "LORA_STEP": 16, "SPLIT_K_DOT": 2, "BLOCK_K": 32}),
    ([i % 4 for i in range(20)], [100], 520, 16, False, {"BLOCK_T": 16, "LORA_PROGRAMS": 1, "SPLIT_K_DOT": 4}),
    ([i % 4 for i in range(20)], [70, 70], 200, 16, True, {"BLOCK_T": 16, "LORA_KS": 64, "LORA_FIRST": 0}),
    ([i % 4 for i in range(18)], [40, 36, 24], 136, 48, False, {"BLOCK_T": 16, "LORA_KS": 64}),
    pytest.param([2, 2, 2], [70, 70], 200, 16, True, {}, marks=EXHAUSTIVE),
    pytest.param([i % 4 for i in range(33)], [40, 36, 24], 136, 8, False, {"LORA_KS": 64}, marks=EXHAUSTIVE),
]


@pytest.mark.parametrize("order", ["grid", "reversed"])
@pytest.mark.parametrize("slots,pieces,K,R,gated,pro,tune", CASES)
def test_gemv_lora_site(slots, pieces, K, R, gated, pro, tune, order, request):
    if order == "reversed":
        request.getfixturevalue("reversed_columns")
    _check(slots, pieces, K, R, gated, pro, tune, narrow=8 if len(slots) > 1 else True)


@pytest.mark.parametrize("order", ["grid", "reversed"])
@pytest.mark.parametrize("slots,pieces,K,R,gated,tune", CASES_ROWS)
def test_gemv_lora_site_of_a_decode_step(slots, pieces, K, R, gated, tune, order, request):
    if order == "reversed":
        request.getfixturevalue("reversed_columns")
    _check(slots, pieces, K, R, gated, False, tune, narrow=False, row_cap=64)


# LORA_SETS: launches of one kernel sharing its scratch at layers that follow each other as a
# program's would (and a step's wrap from the last layer back to the first), different inputs each
# time: every launch finds its set zero, and leaves only its own set's words non-zero
SETS_CASES = [
    ([3], [40, 36, 24], 200, 16, False, True, {"LORA_KS": 64}),
    ([2, 0, 1], [70, 70], 200, 16, True, False, {"LORA_KS": 64, "LORA_PROGRAMS": 2}),
    ([0, 3, 1], [40, 36, 24], 520, 16, False, True, {"LORA_KS": 64, "LORA_PROGRAMS": 3, "LORA_PARTS": 0}),
]


@pytest.mark.parametrize("order", ["grid", "reversed"])
@pytest.mark.parametrize("slots,pieces,K,R,gated,pro,tune", SETS_CASES)
def test_gemv_lora_sets_over_layers(slots, pieces, K, R, gated, pro, tune, order, request):
    if order == "reversed":
        request.getfixturevalue("reversed_columns")
    scratch = None
    for i, layer in enumerate([0, 1, 2, 0, 1]):
        scratch = _check(slots, pieces, K, R, gated, pro, dict(tune, LORA_SETS=1), narrow=8 if len(slots) > 1 else True,
                         layer=layer, scratch=scratch, seed=i)
        words = scratch[LORA_SETS][: LORA_SET_COUNT * LORA_SET_WORDS].reshape(LORA_SET_COUNT, -1)   # a set a row
        own = (layer + 1) % LORA_SET_COUNT
        assert int(words[own, 1]) >= 1          # this launch's arrivals are counted in its own set
        assert int(words[np.arange(LORA_SET_COUNT) != own].abs().sum()) == 0, f"launch {i}: another set's words left"


def test_a_decode_site_needs_a_row_cap():
    with pytest.raises(Exception, match="row_capped_decode"):
        render("gemv", "linear", [("x", ["T", 64], "bf16"), ("w", [32, 64], "bf16", "weight"),
                                  ("a", [4, 16, 64], "bf16", "weight"), ("b", [4, 32, 16], "bf16", "weight"),
                                  ("scale", [4, 1], "f32", "weight")],
               [("y", ["T", 32], "bf16")], lora={"inputs": 3, "pieces": [32], "rank": 16})


def _check(slots, pieces, K, R, gated, pro, tune, narrow, row_cap=0, layer=None, scratch=None, seed=0):
    """One launch against the references; layer / scratch: the launch's layer and an earlier
    launch's scratch (LORA_SETS), returned for the next."""
    gen = np.random.default_rng(K + R + len(slots) + seed)
    T, S, P, NY = len(slots), 4, len(pieces), sum(pieces)
    x, d = rand((T, K), gen=gen), rand((T, K), gen=gen, scale=0.5)
    norm = rand((K,), gen=gen, scale=0.3)
    w = rand((NY, K), gen=gen, scale=K ** -0.5)
    a = rand((S, P * R, K), gen=gen, scale=0.3 * K ** -0.5)
    b = rand((S, NY, R), gen=gen, scale=0.5)
    scale = torch.from_numpy(gen.uniform(0.5, 2.0, (S, P)).astype(np.float32))
    a[0], b[0], scale[0] = 0, 0, 0                      # slot 0: no adapter
    lora_slots = torch.tensor(slots, dtype=torch.int32)
    lora = {"inputs": 3, "pieces": pieces, "rank": R}
    ins = ([("x", ["T", K], "bf16"), ("d", ["T", K], "bf16"), ("norm", [K], "bf16", "weight")] if pro
           else [("x", ["T", K], "bf16")]) + [("w", [NY, K], "bf16", "weight"), ("a", [S, P * R, K], "bf16", "weight"),
                                                ("b", [S, NY, R], "bf16", "weight"), ("scale", [S, P], "f32", "weight")]
    N = NY // 2 if gated else NY
    outs = ([("res", ["T", K], "bf16")] if pro else []) + [("y", ["T", N], "bf16")]
    k = render("gemv_gated" if gated else "gemv", "linear", ins, outs, attrs={"fn": "silu"} if gated else {},
               prologue=PROLOGUE if pro else None, narrow=narrow, lora=lora, tune=tune, row_cap=row_cap)
    tensors = ([x, d, norm] if pro else [x]) + [w, a, b, scale]
    got = poison((T, N))
    bind = {f"in:{i}": t for i, t in enumerate(tensors)}
    bind.update({"out:%d" % (1 if pro else 0): got, "meta:lora_slots": lora_slots})
    if pro:
        bind["out:0"] = poison((T, K))
    scratch = run(k, bind, {"T": T, "B": T}, layer=layer, scratch=scratch)   # asserts counters are left zero
    ctx = SimpleNamespace(meta=SimpleNamespace(lora_slots=np.asarray(slots)))
    h = _f(x)
    if pro:
        _, h = REGISTRY["add_rms_norm"].reference(None, _f(x), _f(d), _f(norm), eps=EPS)
        h = bf16(h)
    y0 = h @ _f(w).T
    xa = REGISTRY["lora_shrink"].reference(ctx, h, _f(a), split=1, prefill_split=1)
    attrs = {"pieces": pieces, "rank": R, "split": 1, "prefill_split": 1}
    if gated:
        want = REGISTRY["lora_expand_act"].reference(ctx, bf16(y0), bf16(xa), _f(b), scale.numpy(), fn="silu", **attrs)
        base = REGISTRY["act_mul"].reference(ctx, bf16(y0), fn="silu")
    else:
        want = REGISTRY["lora_expand"].reference(ctx, y0, bf16(xa), _f(b), scale.numpy(), **attrs)
        base = y0
    assert rel_err(_f(got), want) < 2e-2
    hit = np.asarray(slots) != 0
    if hit.any():      # the adapters matter: the delta is measured, not lost in the base output
        assert rel_err((_f(got) - base)[hit], (want - base)[hit]) < 6e-2
        assert np.abs(want - base)[hit].max() > 0.05 * np.abs(base).max()
    if not hit.all():  # no adapter: the base GEMV's output
        assert rel_err(_f(got)[~hit], base[~hit]) < 1e-2
    return scratch


# A decode site whose shrink is a launch of its own (merge_lora with infc/config.py
# LORA_DECODE_EXPAND; gemv.py.j2 LAPART): the GEMV takes the shrink's output (split 0 the sum; the
# other splits NaN here: never read) and adds only the delta; rows of four slots over row blocks,
# ragged pieces, split-K, plain and gated, no row cap (no scratch)
CASES_APART = [
    ([i % 4 for i in range(37)], [40, 36, 24], 200, 16, False, {"BLOCK_T": 16}),
    ([1, 0, 3, 2, 3, 1], [70, 70], 136, 8, True, {"SPLIT_K_DOT": 2, "BLOCK_K": 32}),
    ([i % 4 for i in range(20)], [100], 520, 48, False, {"BLOCK_T": 16}),
]


@pytest.mark.parametrize("slots,pieces,K,R,gated,tune", CASES_APART)
def test_gemv_lora_site_with_its_shrink_apart(slots, pieces, K, R, gated, tune):
    gen = np.random.default_rng(K + R + len(slots))
    T, S, P, NY, SPLITS = len(slots), 4, len(pieces), sum(pieces), 3
    x = rand((T, K), gen=gen)
    w = rand((NY, K), gen=gen, scale=K ** -0.5)
    a = rand((S, P * R, K), gen=gen, scale=0.3 * K ** -0.5)
    b = rand((S, NY, R), gen=gen, scale=0.5)
    scale = torch.from_numpy(gen.uniform(0.5, 2.0, (S, P)).astype(np.float32))
    a[0], b[0], scale[0] = 0, 0, 0
    ctx = SimpleNamespace(meta=SimpleNamespace(lora_slots=np.asarray(slots)))
    xa_sum = REGISTRY["lora_shrink"].reference(ctx, _f(x), _f(a), split=1, prefill_split=1)
    xa = torch.full((T, SPLITS, P * R), float("nan"), dtype=torch.float32)
    xa[:, 0] = torch.from_numpy(np.asarray(xa_sum, np.float32).reshape(T, P * R))
    xa = xa.reshape(T, SPLITS * P * R)                     # the plan's layout of lora_shrink's output
    N = NY // 2 if gated else NY
    k = render("gemv_gated" if gated else "gemv", "linear",
               [("x", ["T", K], "bf16"), ("w", [NY, K], "bf16", "weight"), ("xa", ["T", SPLITS * P * R], "f32"),
                ("b", [S, NY, R], "bf16", "weight"), ("scale", [S, P], "f32", "weight")],
               [("y", ["T", N], "bf16")], attrs={"fn": "silu"} if gated else {}, narrow=False,
               lora={"inputs": 3, "pieces": pieces, "rank": R, "shrink": "apart"}, tune=tune)
    assert "lora_part" not in k.meta.get("scratch", {}) and "counters_lora" not in k.meta.get("scratch", {})
    got = poison((T, N))
    run(k, {"in:0": x, "in:1": w, "in:2": xa, "in:3": b, "in:4": scale, "out:0": got,
            "meta:lora_slots": torch.tensor(slots, dtype=torch.int32)}, {"T": T, "B": T})
    y0 = _f(x) @ _f(w).T
    attrs = {"pieces": pieces, "rank": R, "split": 1, "prefill_split": 1}
    if gated:
        want = REGISTRY["lora_expand_act"].reference(ctx, bf16(y0), bf16(xa_sum), _f(b), scale.numpy(), fn="silu", **attrs)
    else:
        want = REGISTRY["lora_expand"].reference(ctx, y0, bf16(xa_sum), _f(b), scale.numpy(), **attrs)
    assert rel_err(_f(got), want) < 2e-2
    hit = np.asarray(slots) != 0
    base = REGISTRY["act_mul"].reference(ctx, bf16(y0), fn="silu") if gated else y0
    assert rel_err((_f(got) - base)[hit], (want - base)[hit]) < 6e-2
