"""GEMV/GEMM-family templates under the interpreter, against their ops' numpy references.

Every case uses random (never zero) inputs, NaN-poisoned outputs and shapes that the blocks do
not cover (small tune overrides), and exercises each kernel path: the CUDA-core rows path and
the tensor-core path of the GEMVs, split-K with its counters left zero, masked edges of the GEMM;
with and without a bias, T or B rows, bf16 or f32 outputs, and every gated activation.
"""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from infc.compiler.codegen.render import TemplateError
from infc.compiler.ops import REGISTRY
from infc.compiler.ops.activation import ACTIVATIONS

from infc.compiler.contract.bind import grid

from exhaustive import pairwise

from .harness import bf16, poison, rand, rel_err, render, run

TOL = 1e-2


def f32(t):
    return t.float().numpy()


def check_scratch_zero(scratch):
    """The split-K arrival counters are left zero for the next launch (the partial-sum slots are
    overwritten by every split before they are read, so they may keep values)."""
    for name, s in scratch.items():
        if name == "counters":
            assert int(s.abs().sum()) == 0, f"scratch '{name}' not left zero"


# (T, N, K, tune, path): small blocks so that N and K are not multiples of them.
GEMV_CASES = [
    (1, 100, 72, {"BLOCK_N": 16, "BLOCK_K": 16, "FMA_BLOCK_K": 32, "SPLIT_K": 3}, "fma+split"),
    (3, 100, 72, {"BLOCK_N": 32, "BLOCK_K": 16, "FMA_BLOCK_K": 16, "BLOCK_T": 16, "FMA_T": 4}, "fma rows"),
    (5, 96, 136, {"BLOCK_N": 16, "BLOCK_N_DOT": 32, "BLOCK_K": 32, "FMA_BLOCK_K": 32, "BLOCK_T": 16,
                  "SPLIT_K_DOT": 4}, "dot+split"),
    (17, 100, 136, {"BLOCK_N": 32, "BLOCK_N_DOT": 16, "BLOCK_K": 32, "FMA_BLOCK_K": 16, "BLOCK_T": 16,
                    "SPLIT_K_DOT": 4}, "dot 2 row blocks+split"),
    (2, 130, 256, {}, "defaults"),
]


@pytest.mark.parametrize("T,N,K,tune,path", GEMV_CASES, ids=[c[-1] for c in GEMV_CASES])
def test_gemv(T, N, K, tune, path):
    gen = np.random.default_rng(T * 1000 + N)
    x, w = rand((T, K), gen=gen), rand((N, K), gen=gen, scale=K ** -0.5)
    k = render("gemv", "linear", [("x", ["T", K], "bf16"), ("w", [N, K], "bf16", "weight")],
               [("y", ["T", N], "bf16")], tune=tune)
    y = poison((T, N))
    scratch = run(k, {"in:0": x, "in:1": w, "out:0": y}, {"T": T, "B": 1})
    check_scratch_zero(scratch)
    assert (len(scratch) > 0) == ("split" in path)
    want = REGISTRY["linear"].reference(None, f32(x), f32(w))
    assert rel_err(f32(y), want) <= TOL


# (T, N, K, tune, splits): splits is the grid's z, the K ranges a tile is summed over (split-K
# when the tiles are few and T <= SPLIT_ROWS; K ranges ragged against BLOCK_K included)
GEMM_CASES = [
    (1, 100, 72, {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32}, 1),
    (17, 100, 72, {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2}, 1),
    (70, 130, 200, {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 2}, 1),
    (37, 130, 200, {}, 1),
    (1, 100, 72, {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "SPLIT_K": 4}, 3),
    (50, 100, 300, {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "SPLIT_K": 3, "TARGET_CTAS": 1000}, 3),
    (50, 100, 300, {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "SPLIT_K": 3, "TARGET_CTAS": 40}, 2),
    (40, 100, 300, {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "SPLIT_K": 3, "SPLIT_ROWS": 32}, 1),
]


@pytest.mark.parametrize("T,N,K,tune,splits", GEMM_CASES)
def test_gemm(T, N, K, tune, splits):
    gen = np.random.default_rng(T * 1000 + N + 1)
    x, w = rand((T, K), gen=gen), rand((N, K), gen=gen, scale=K ** -0.5)
    k = render("gemm", "linear", [("x", ["T", K], "bf16"), ("w", [N, K], "bf16", "weight")],
               [("y", ["T", N], "bf16")], phase="prefill", tune=tune)
    assert grid(k.meta, {"T": T, "B": 1})[1] == splits
    y = poison((T, N))
    run(k, {"in:0": x, "in:1": w, "out:0": y}, {"T": T, "B": 1})   # (run checks the counters reset)
    want = REGISTRY["linear"].reference(None, f32(x), f32(w))
    assert rel_err(f32(y), want) <= TOL


# The tile loop's three forms: TMA descriptors with persistent programs (the default where the
# rows are 16-byte aligned), TMA with a program per tile, pointer loads. NUM_SMS 3 makes each
# persistent program take several tiles; K = 300 is not 16-byte aligned (pointer loads).
TILE_LOOPS = [({"NUM_SMS": 3}, "tma persistent"), ({"PERSISTENT": 0}, "tma"), ({"TMA": 0}, "pointers")]


# each tile loop on each shape; the bias pairwise with both (all 18 with --exhaustive)
@pytest.mark.parametrize("T,N,K,over,loop,bias", pairwise(
    [(70, 130, 200), (37, 100, 72), (1, 40, 64)], TILE_LOOPS, [False, True],
    ids=[None, [c[1] for c in TILE_LOOPS], None]))
def test_gemm_tile_loops(T, N, K, over, loop, bias):
    gen = np.random.default_rng(T + N + K)
    arrays = [rand((T, K), gen=gen), rand((N, K), gen=gen, scale=K ** -0.5)]
    inputs = [("x", ["T", K], "bf16"), ("w", [N, K], "bf16", "weight")]
    if bias:
        arrays.append(rand((N,), gen=gen, scale=0.3))
        inputs.append(("b", [N], "bf16", "weight"))
    k = render("gemm", "linear", inputs, [("y", ["T", N], "bf16")], attrs={"has_bias": bias}, phase="prefill",
               tune={"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 2, **over})
    assert ("make_tensor_descriptor" in k.source) == (loop != "pointers")
    assert ("flatten=True" in k.source) == (loop == "tma persistent")
    tiles = -(-T // 32) * -(-N // 32)
    assert grid(k.meta, {"T": T, "B": 1})[0] == (min(3, tiles) if loop == "tma persistent" else tiles)
    y = poison((T, N))
    run(k, {f"in:{i}": a for i, a in enumerate(arrays)} | {"out:0": y}, {"T": T, "B": 1})
    want = REGISTRY["linear"].reference(None, *[f32(a) for a in arrays], has_bias=bias)
    assert rel_err(f32(y), want) <= TOL


def test_gemm_keeps_pointer_loads_where_tma_cannot_go():
    """Rows not 16-byte aligned (K = 300), and split-K, load through pointers."""
    x, w = [("x", ["T", 300], "bf16"), ("w", [64, 300], "bf16", "weight")], [("y", ["T", 64], "bf16")]
    assert "make_tensor_descriptor" not in render("gemm", "linear", x, w, phase="prefill").source
    split = render("gemm", "linear", [("x", ["T", 256], "bf16"), ("w", [64, 256], "bf16", "weight")], w,
                   phase="prefill", tune={"SPLIT_K": 2})
    assert "make_tensor_descriptor" not in split.source and "part_ptr" in split.source
    aligned = render("gemm", "linear", [("x", ["T", 256], "bf16"), ("w", [64, 256], "bf16", "weight")], w,
                     phase="prefill")
    assert "make_tensor_descriptor" in aligned.source


ACTS = sorted(ACTIVATIONS)


# (rows symbol, rows, out dtype, bias): a bias (bf16 or f32) added once in the fp32 epilogue,
# B-row inputs (linear after last()), f32 outputs (logits of an unfused lm_head).
VARIANTS = [("T", "bf16", "bf16"), ("B", "f32", None), ("B", "bf16", "f32"), ("T", "f32", "bf16")]


def _linear_case(template, phase, T, N, K, tune, sym, out_dtype, bias, path=""):
    gen = np.random.default_rng(T * 1000 + N + K)
    x, w = rand((T, K), gen=gen), rand((N, K), gen=gen, scale=K ** -0.5)
    inputs = [("x", [sym, K], "bf16"), ("w", [N, K], "bf16", "weight")]
    arrays = [x, w]
    if bias:
        inputs.append(("b", [N], bias, "weight"))
        arrays.append(rand((N,), bias, gen=gen))   # as large as y: a missing or doubled b shows
    attrs = {"has_bias": bool(bias)}
    k = render(template, "linear", inputs, [("y", [sym, N], out_dtype)], attrs=attrs, phase=phase, tune=tune)
    assert ("b_ptr" in k.source) == bool(bias) and f'"dim:{sym}"' in k.source
    y = poison((T, N), out_dtype)
    dims = {"T": T if sym == "T" else T + 5, "B": T if sym == "B" else 1}
    scratch = run(k, {f"in:{i}": a for i, a in enumerate(arrays)} | {"out:0": y}, dims)
    check_scratch_zero(scratch)
    if path:
        assert (len(scratch) > 0) == ("split" in path)
    want = REGISTRY["linear"].reference(None, *[f32(a) for a in arrays], **attrs)
    assert rel_err(f32(y), want) <= TOL


@pytest.mark.parametrize("sym,out_dtype,bias", VARIANTS)
@pytest.mark.parametrize("T,N,K,tune,path", GEMV_CASES, ids=[c[-1] for c in GEMV_CASES])
def test_gemv_bias_rows_dtypes(T, N, K, tune, path, sym, out_dtype, bias):
    _linear_case("gemv", "decode", T, N, K, tune, sym, out_dtype, bias, path)


@pytest.mark.parametrize("sym,out_dtype,bias", VARIANTS)
@pytest.mark.parametrize("T,N,K,tune", [c[:4] for c in GEMM_CASES])
def test_gemm_bias_rows_dtypes(T, N, K, tune, sym, out_dtype, bias):
    _linear_case("gemm", "prefill", T, N, K, tune, sym, out_dtype, bias)


@pytest.mark.parametrize("template,phase,tune", [
    ("gemv", "decode", {"BLOCK_N": 16, "BLOCK_K": 16, "FMA_BLOCK_K": 32, "SPLIT_K": 2}),
    ("gemv", "decode", {"BLOCK_N_DOT": 16, "BLOCK_K": 16, "BLOCK_T": 16}),
    ("gemm", "prefill", {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16}),
])
@pytest.mark.parametrize("T", [1, 7])
def test_linear_rows_times_static_dims(template, phase, tune, T):
    """x [T, 3, K]: 3 T rows of one matrix (the kernel scales its row count, the grid too)."""
    gen = np.random.default_rng(T)
    N, K = 40, 48
    x, w, b = rand((T, 3, K), gen=gen), rand((N, K), gen=gen, scale=K ** -0.5), rand((N,), gen=gen)
    k = render(template, "linear", [("x", ["T", 3, K], "bf16"), ("w", [N, K], "bf16", "weight"),
                                    ("b", [N], "bf16", "weight")],
               [("y", ["T", 3, N], "bf16")], attrs={"has_bias": True}, phase=phase, tune=tune)
    assert "T * 3" in k.meta["grid"][0]
    y = poison((T, 3, N))
    scratch = run(k, {"in:0": x, "in:1": w, "in:2": b, "out:0": y}, {"T": T, "B": 1})
    check_scratch_zero(scratch)
    want = REGISTRY["linear"].reference(None, f32(x), f32(w), f32(b), has_bias=True)
    assert rel_err(f32(y), want) <= TOL


def test_linear_rows_must_be_a_step_symbol():
    with pytest.raises(TemplateError, match="rows_must_be"):
        render("gemv", "linear", [("x", [4, 64], "bf16"), ("w", [32, 64], "bf16", "weight")],
               [("y", [4, 32], "bf16")])


def _act_mul_case(template, phase, T, N, F, tune, fn, bias, out_dtype="bf16"):
    gen = np.random.default_rng(T * 1000 + N + F)
    gu, w = rand((T, 2 * F), gen=gen, scale=2.0), rand((N, F), gen=gen, scale=F ** -0.5)
    inputs = [("gu", ["T", 2 * F], "bf16"), ("w", [N, F], "bf16", "weight")]
    arrays = [gu, w]
    if bias:
        inputs.append(("b", [N], "bf16", "weight"))
        arrays.append(rand((N,), gen=gen, scale=0.3))
    attrs = {"fn": fn, "has_bias": bias}
    k = render(template, "linear_act_mul", inputs, [("y", ["T", N], out_dtype)], attrs=attrs, phase=phase,
               tune=tune)
    assert k.meta["entry"].endswith(f"_{fn}_mul")
    y = poison((T, N), out_dtype)
    scratch = run(k, {f"in:{i}": a for i, a in enumerate(arrays)} | {"out:0": y}, {"T": T, "B": 1})
    check_scratch_zero(scratch)
    want = REGISTRY["linear_act_mul"].reference(None, *[f32(a) for a in arrays], **attrs)
    assert rel_err(f32(y), want) <= TOL


@pytest.mark.parametrize("fn", ACTS)
@pytest.mark.parametrize("T,N,F,tune,bias", [
    (1, 100, 72, {"BLOCK_N": 16, "BLOCK_K": 16, "FMA_BLOCK_K": 32, "SPLIT_K": 2}, True),
    (3, 100, 72, {"BLOCK_N": 32, "BLOCK_K": 16, "FMA_BLOCK_K": 16, "BLOCK_T": 16, "FMA_T": 4}, False),
    (17, 100, 72, {"BLOCK_N": 32, "BLOCK_N_DOT": 32, "BLOCK_K": 32, "FMA_BLOCK_K": 32, "BLOCK_T": 16,
                   "SPLIT_K_DOT": 2}, True),
])
def test_gemv_act_mul(T, N, F, tune, bias, fn):
    _act_mul_case("gemv_act_mul", "decode", T, N, F, tune, fn, bias)


# The short phase (prefill/mixed steps of T <= SHORT_TOKENS) runs the decode GEMVs with T > B:
# rows come from dim:T only, never from B or the sequence metadata. Defaults (what a short shape
# renders until it is tuned) and tilings whose launch splits K (grid z > 1) over one or two row
# blocks; B < T, and 2 rows <= FMA_T put the CUDA-core rows path in play too.
SHORT_CASES = [(2, 1, {}), (17, 3, {}), (64, 5, {}),
               (2, 1, {"FMA_T": 2, "FMA_BLOCK_K": 32, "BLOCK_N": 16, "SPLIT_K": 2}),
               (17, 3, {"BLOCK_N_DOT": 32, "BLOCK_K": 32, "FMA_BLOCK_K": 32, "BLOCK_T": 16, "SPLIT_K_DOT": 4}),
               (64, 5, {"BLOCK_N_DOT": 32, "BLOCK_K": 32, "FMA_BLOCK_K": 32, "BLOCK_T": 32, "SPLIT_K_DOT": 4})]


def _short_grid_splits(k, T, B, tune):
    from infc.compiler.contract.bind import grid
    assert (grid(k.meta, {"T": T, "B": B})[2] > 1) == bool(tune)


def test_short_phase_selects_the_gemvs():
    assert REGISTRY["linear"].template("triton", "short") == "gemv"
    assert REGISTRY["linear_act_mul"].template("triton", "short") == "gemv_act_mul"
    assert REGISTRY["linear"].template("tilelang", "short", inherit=False) is None   # mixed's GEMM
    assert REGISTRY["moe_down"].template("triton", "short") == "moe_down_grouped"    # via mixed


@pytest.mark.parametrize("T,B,tune", SHORT_CASES)
def test_gemv_short_rows(T, B, tune):
    gen = np.random.default_rng(T * 10 + B)
    N, K = 100, 136
    x, w = rand((T, K), gen=gen), rand((N, K), gen=gen, scale=K ** -0.5)
    k = render("gemv", "linear", [("x", ["T", K], "bf16"), ("w", [N, K], "bf16", "weight")],
               [("y", ["T", N], "bf16")], phase="short", tune=tune)
    assert '"dim:T"' in k.source and "meta:" not in k.source
    _short_grid_splits(k, T, B, tune)
    y = poison((T, N))
    scratch = run(k, {"in:0": x, "in:1": w, "out:0": y}, {"T": T, "B": B})
    check_scratch_zero(scratch)
    assert rel_err(f32(y), REGISTRY["linear"].reference(None, f32(x), f32(w))) <= TOL


@pytest.mark.parametrize("fn", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("T,B,tune", SHORT_CASES)
def test_gemv_act_mul_short_rows(T, B, tune, fn):
    gen = np.random.default_rng(T * 10 + B + 1)
    N, F = 100, 136
    gu, w = rand((T, 2 * F), gen=gen, scale=2.0), rand((N, F), gen=gen, scale=F ** -0.5)
    k = render("gemv_act_mul", "linear_act_mul", [("gu", ["T", 2 * F], "bf16"), ("w", [N, F], "bf16", "weight")],
               [("y", ["T", N], "bf16")], attrs={"fn": fn, "has_bias": False}, phase="short", tune=tune)
    assert '"dim:T"' in k.source and "meta:" not in k.source
    _short_grid_splits(k, T, B, tune)
    y = poison((T, N))
    scratch = run(k, {"in:0": gu, "in:1": w, "out:0": y}, {"T": T, "B": B})
    check_scratch_zero(scratch)
    want = REGISTRY["linear_act_mul"].reference(None, f32(gu), f32(w), fn=fn)
    assert rel_err(f32(y), want) <= TOL


@pytest.mark.parametrize("fn", ACTS)
@pytest.mark.parametrize("T,N,F,tune,bias", [
    (1, 100, 72, {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32}, False),
    (17, 100, 72, {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2}, True),
    (40, 130, 200, {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64}, False),    # split-K by default
    (17, 100, 72, {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16, "SPLIT_K": 3}, True),   # the bias once
])
def test_gemm_act_mul(T, N, F, tune, bias, fn):
    _act_mul_case("gemm_act_mul", "prefill", T, N, F, tune, fn, bias)


# A row-parallel down projection (tensor parallelism) writes its partial sums in fp32
@pytest.mark.parametrize("template,phase,T,tune", [
    ("gemv_act_mul", "decode", 1, {"BLOCK_N": 16, "BLOCK_K": 16, "FMA_BLOCK_K": 32, "SPLIT_K": 2}),
    ("gemv_act_mul", "decode", 17, {"BLOCK_N_DOT": 32, "BLOCK_K": 32, "BLOCK_T": 16, "SPLIT_K_DOT": 2}),
    ("gemm_act_mul", "prefill", 40, {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64}),
    ("gemm_act_mul", "prefill", 17, {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16, "SPLIT_K": 3}),
])
def test_linear_act_mul_f32_partials(template, phase, T, tune):
    _act_mul_case(template, phase, T, 100, 72, tune, "silu", False, out_dtype="f32")


@pytest.mark.parametrize("template", ["gemv", "gemv_act_mul"])
@pytest.mark.parametrize("tune", [{}, {"FMA_T": 4, "BLOCK_N": 16, "BLOCK_K": 32, "FMA_BLOCK_K": 32, "SPLIT_K": 2}])
def test_gemv_f32_partials_are_batch_invariant(template, tune):
    """A row-parallel linear's fp32 partials (attrs out_dtype f32): a row's bits are the same
    alone and in batches of any size (every row count takes the tensor-core path); a plain f32
    GEMV (the CUDA-core path for few rows) need not be, which is why."""
    gen = np.random.default_rng(5)
    N, K = 96, 136
    op = "linear_act_mul" if template == "gemv_act_mul" else "linear"
    a = rand((40, 2 * K if op == "linear_act_mul" else K), gen=gen)
    w = rand((N, K), gen=gen, scale=K ** -0.5)
    attrs = {"has_bias": False, **({"fn": "silu"} if op == "linear_act_mul" else {})}
    rows = {}
    for partial in (True, False):
        k = render(template, op, [("a", ["T", a.shape[1]], "bf16"), ("w", [N, K], "bf16", "weight")],
                   [("y", ["T", N], "f32")], attrs={**attrs, **({"out_dtype": "f32"} if partial else {})},
                   phase="decode", tune=tune)
        for T in (1, 3, 17, 40):
            y = poison((T, N), "f32")
            run(k, {"in:0": a[:T].contiguous(), "in:1": w, "out:0": y}, {"T": T, "B": T})
            want = REGISTRY[op].reference(None, f32(a[:T]), f32(w), **attrs)
            assert rel_err(f32(y), want) <= TOL
            rows[partial, T] = y[0].numpy().copy()
    for T in (3, 17, 40):
        assert np.array_equal(rows[True, T], rows[True, 1]), T
    # the plain GEMV's single row (CUDA cores) and batched row (tensor cores) differ in low bits
    assert not np.array_equal(rows[False, 17], rows[False, 1])


@pytest.mark.parametrize("fn", ACTS)
@pytest.mark.parametrize("shape,sym,block", [((1, 2), "T", None), ((3, 200), "T", None),
                                             ((2, 5200), "B", 1024), ((2, 3, 70), "T", 32)])
def test_act_mul(shape, sym, block, fn):
    gen = np.random.default_rng(sum(shape))
    gu = rand(shape, scale=2.0, gen=gen)
    out_shape = shape[:-1] + (shape[-1] // 2,)
    syms = [sym] + list(shape[1:])
    k = render("act_mul", "act_mul", [("gu", syms, "bf16")], [("y", syms[:-1] + [out_shape[-1]], "bf16")],
               attrs={"fn": fn}, tune={"BLOCK": block} if block else None)
    out = poison(out_shape)
    run(k, {"in:0": gu, "out:0": out}, {"T": shape[0], "B": shape[0]})
    want = REGISTRY["act_mul"].reference(None, f32(gu), fn=fn)
    assert rel_err(f32(out), want) < 1e-2
    assert np.abs(f32(out) - want).max() <= 2 ** -8 * np.abs(want).max() + 1e-6
    # one rounding of act(g) * u, not HF's bf16(bf16(act(g)) * u) (act_mul.py.j2 says why)
    hf, once = hf_gated(f32(gu), fn)
    # (>= 0.97: the fp32 GELUs lose relative precision in their negative tails, where float64's
    # value rounds the other way now and then; the other order matches 68-90 % of elements)
    assert (f32(out) == once).mean() >= 0.97
    if out.numel() >= 100 and fn != "relu":       # relu(g) is exact in bf16: both orders agree
        assert (f32(out) == hf).mean() < 0.92


def hf_gated(gu, fn):
    """(HF's bf16(bf16(act(g)) * u), one rounding bf16(act(g) * u)) of a [.., 2F] gate|up array,
    act in float64."""
    f = gu.shape[-1] // 2
    g, u = gu[..., :f].astype(np.float64), gu[..., f:].astype(np.float64)
    a = ACTIVATIONS[fn](g)
    return bf16(bf16(a) * u), bf16(a * u)


def test_gelu_tanh_defines_its_tanh_helper_only_when_used():
    args = ([("gu", ["T", 64], "bf16"), ("w", [32, 32], "bf16", "weight")], [("y", ["T", 32], "bf16")])
    for template in ("gemv_act_mul", "gemm_act_mul"):
        assert "def _tanh" in render(template, "linear_act_mul", *args, attrs={"fn": "gelu_tanh"}).source
        assert "def _tanh" not in render(template, "linear_act_mul", *args, attrs={"fn": "gelu"}).source


# (T, B, V, H, residual, bias, softcap, tune)
LM_HEAD_CASES = [
    (5, 1, 100, 72, True, False, None, {"BLOCK_N": 16, "BLOCK_K": 16, "FMA_BLOCK_K": 32}),
    (9, 3, 100, 72, False, False, None, {"BLOCK_N": 32, "BLOCK_K": 16, "FMA_BLOCK_K": 16, "BLOCK_T": 16,
                                        "FMA_T": 4}),
    (40, 17, 100, 72, True, False, None, {"BLOCK_N": 32, "BLOCK_N_DOT": 32, "BLOCK_K": 32,
                                          "FMA_BLOCK_K": 32, "BLOCK_T": 16}),
    (6, 2, 90, 136, True, False, None, {}),
    (5, 1, 100, 72, True, True, 1.5, {"BLOCK_N": 16, "BLOCK_K": 16, "FMA_BLOCK_K": 32}),
    (9, 3, 100, 72, False, True, None, {"BLOCK_N": 32, "BLOCK_K": 16, "FMA_BLOCK_K": 16, "BLOCK_T": 16,
                                        "FMA_T": 4}),
    (40, 17, 100, 72, True, True, 2.0, {"BLOCK_N": 32, "BLOCK_N_DOT": 32, "BLOCK_K": 32,
                                        "FMA_BLOCK_K": 32, "BLOCK_T": 16}),
    (6, 2, 90, 136, False, False, 1.0, {}),
    (20, 18, 90, 136, True, True, 30, {}),
]


@pytest.mark.parametrize("T,B,V,H,residual,bias,softcap,tune", LM_HEAD_CASES)
def test_lm_head_last(T, B, V, H, residual, bias, softcap, tune):
    gen = np.random.default_rng(T * 100 + B)
    x, d = rand((T, H), gen=gen), rand((T, H), gen=gen)
    norm, w = rand((H,), gen=gen, scale=0.3) + 1.0, rand((V, H), gen=gen, scale=H ** -0.5)
    last = np.sort(gen.choice(T, size=B, replace=False)).astype(np.int32)
    inputs = [("x", ["T", H], "bf16")] + ([("d", ["T", H], "bf16")] if residual else [])
    inputs += [("norm", [H], "bf16", "weight"), ("w", [V, H], "bf16", "weight")]
    arrays = [x] + ([d] if residual else []) + [norm, w]
    if bias:
        inputs.append(("b", [V], "bf16", "weight"))
        arrays.append(rand((V,), gen=gen))
    attrs = {"eps": 1e-6, "residual": residual, "softcap": softcap, "has_bias": bias}
    k = render("lm_head_last", "lm_head_last", inputs, [("logits", ["B", V], "f32")], attrs=attrs, tune=tune)
    out = poison((B, V), "f32")
    bindings = {f"in:{i}": a for i, a in enumerate(arrays)}
    bindings.update({"out:0": out, "meta:last_rows": torch.from_numpy(last)})
    scratch = run(k, bindings, {"T": T, "B": B})
    check_scratch_zero(scratch)
    ctx = SimpleNamespace(last_rows=last.astype(np.int64))
    want = REGISTRY["lm_head_last"].reference(ctx, *[f32(a) for a in arrays], **attrs)
    assert rel_err(out.numpy(), want) <= TOL
    if softcap:
        assert np.abs(out.numpy()).max() <= softcap


def test_lm_head_last_refuses_split_k():
    with pytest.raises(TemplateError, match="cannot_split"):
        render("lm_head_last", "lm_head_last", [("x", ["T", 64], "bf16"), ("norm", [64], "bf16", "weight"),
                                                ("w", [100, 64], "bf16", "weight")],
               [("logits", ["B", 100], "f32")], attrs={"eps": 1e-6, "residual": False}, tune={"SPLIT_K": 2})


# (T, KT, E, H, F, tune_gate_up, tune_down)
MOE_CASES = [
    (1, 3, 5, 72, 40, {"BLOCK_F": 16, "BLOCK_K": 32}, {"BLOCK_H": 16, "BLOCK_F": 16}),
    (3, 2, 4, 64, 24, {"BLOCK_F": 16, "BLOCK_K": 16}, {"BLOCK_H": 16, "FMA_BLOCK_K": 16}),
    (5, 8, 10, 72, 40, {"BLOCK_F": 32}, {}),
    (17, 2, 3, 40, 24, {"BLOCK_F": 32, "BLOCK_K": 32}, {"BLOCK_H": 32, "BLOCK_F": 16}),
]


def _moe_inputs(T, KT, E, H, F):
    gen = np.random.default_rng(T * 10 + KT)
    x = rand((T, H), gen=gen)
    ids = np.stack([gen.choice(E, size=KT, replace=False) for _ in range(T)]).astype(np.int32)
    rw = torch.from_numpy(gen.random((T, KT)).astype(np.float32) + 0.1)
    gu = rand((E, 2 * F, H), gen=gen, scale=H ** -0.5)
    down = rand((E, H, F), gen=gen, scale=F ** -0.5)
    return x, torch.from_numpy(ids), rw, gu, down


@pytest.mark.parametrize("T,KT,E,H,F,tune,_", MOE_CASES)
def test_moe_gate_up(T, KT, E, H, F, tune, _):
    x, ids, rw, gu, down = _moe_inputs(T, KT, E, H, F)
    k = render("moe_gate_up", "moe_gate_up", [("x", ["T", H], "bf16"), ("ids", ["T", KT], "i32"),
                                              ("gate_up", [E, 2 * F, H], "bf16", "weight")],
               [("act", ["T", KT, F], "bf16")], tune=tune)
    act = poison((T, KT, F))
    run(k, {"in:0": x, "in:1": ids, "in:2": gu, "out:0": act}, {"T": T, "B": T})   # decode: T == B
    want = REGISTRY["moe_gate_up"].reference(None, f32(x), ids.numpy(), f32(gu))
    assert rel_err(f32(act), want) <= TOL


@pytest.mark.parametrize("T,KT,E,H,F,_,tune", MOE_CASES)
def test_moe_down(T, KT, E, H, F, _, tune):
    x, ids, rw, gu, down = _moe_inputs(T, KT, E, H, F)
    act = rand((T, KT, F), gen=np.random.default_rng(T), scale=0.5)
    k = render("moe_down", "moe_down", [("act", ["T", KT, F], "bf16"), ("weights", ["T", KT], "f32"),
                                        ("ids", ["T", KT], "i32"), ("down", [E, H, F], "bf16", "weight")],
               [("y", ["T", H], "bf16")], tune=tune)
    y = poison((T, H))
    run(k, {"in:0": act, "in:1": rw, "in:2": ids, "in:3": down, "out:0": y}, {"T": T, "B": T})   # decode: T == B
    want = REGISTRY["moe_down"].reference(None, f32(act), rw.numpy(), ids.numpy(), f32(down))
    assert rel_err(f32(y), want) <= TOL


def test_split_k_where_the_tiles_are_few():
    """Qwen3-4B's down projection (N 2560, K 9728) at a 511-row mixed step has 40 tiles of
    128 x 256: gemm_act_mul splits K 4 ways there, not past SPLIT_ROWS; the plain GEMM (o_proj,
    N 2560, K 4096) does not split by default."""
    down = render("gemm_act_mul", "linear_act_mul", [("gu", ["T", 2 * 9728], "bf16"), ("w", [2560, 9728], "bf16", "weight")],
                  [("y", ["T", 2560], "bf16")], attrs={"fn": "silu", "has_bias": False}, phase="mixed")
    assert [grid(down.meta, {"T": t, "B": 1})[1] for t in (64, 511, 1024, 2048)] == [4, 4, 3, 1]
    assert int(down.meta["scratch"]["partials"]) == 4 * 1024 * 2560 * 4
    wo = render("gemm", "linear", [("x", ["T", 4096], "bf16"), ("w", [2560, 4096], "bf16", "weight")],
                [("y", ["T", 2560], "bf16")], phase="mixed")
    assert grid(wo.meta, {"T": 511, "B": 1})[1] == 1 and "scratch" not in wo.meta
