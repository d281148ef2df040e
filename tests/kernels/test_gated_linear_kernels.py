"""gemv_gated / gemm_gated (linear_gated: the gate|up projection with act(gate) * up in its
epilogue) under the interpreter, against the op's numpy reference and HF's order of roundings.

Random inputs, NaN-poisoned outputs, shapes the tiles do not cover, every kernel path (the GEMV's
CUDA-core and tensor-core paths, split-K with its counters left zero, the GEMM's edges and
split-K), with and without a bias, every gated activation.
"""
import numpy as np
import pytest
import torch

from infc.compiler.codegen.render import TemplateError
from infc.compiler.ops import REGISTRY
from infc.compiler.ops.activation import ACTIVATIONS

from exhaustive import pairwise

from .harness import bf16, poison, rand, rel_err, render, run
from .test_gemm_kernels import ACTS, check_scratch_zero, f32
from .test_gemm_kernels import GEMV_CASES as GEMM_GEMV_CASES

TOL = 1e-2


def _render(template, phase, F, K, fn, bias, tune, rows="T"):
    inputs = [("x", [rows, K], "bf16"), ("w", [2 * F, K], "bf16", "weight")]
    if bias:
        inputs.append(("b", [2 * F], "bf16", "weight"))
    return render(template, "linear_gated", inputs, [("y", [rows, F], "bf16")],
                  attrs={"fn": fn, "has_bias": bias}, phase=phase, tune=tune)


def _case(template, phase, T, F, K, tune, fn, bias, B=1):
    gen = np.random.default_rng(T * 1000 + F + K)
    arrays = [rand((T, K), gen=gen), rand((2 * F, K), gen=gen, scale=2 * K ** -0.5)]
    if bias:
        arrays.append(rand((2 * F,), gen=gen, scale=0.3))
    k = _render(template, phase, F, K, fn, bias, tune)
    assert k.meta["entry"] == f"{template.split('_')[0]}_{fn}_gated"
    y = poison((T, F))
    scratch = run(k, {f"in:{i}": a for i, a in enumerate(arrays)} | {"out:0": y}, {"T": T, "B": B})
    check_scratch_zero(scratch)
    want = REGISTRY["linear_gated"].reference(None, *[f32(a) for a in arrays], fn=fn, has_bias=bias)
    assert rel_err(f32(y), want) <= TOL
    return k, scratch


# test_gemm_kernels' GEMV cases (T, N, K, tune, path) with F = N / 2 output columns: F and K are
# not multiples of the blocks, and every GEMV path is taken
GEMV_CASES = [(T, N // 2, K, tune, path) for T, N, K, tune, path in GEMM_GEMV_CASES]


# every path with and without a bias and with each activation, pairwise (the fast suite; the
# whole product with --exhaustive): each activation has its own test below
@pytest.mark.parametrize("T,F,K,tune,path,bias,fn", pairwise(GEMV_CASES, [False, True], ["silu", "gelu_tanh"],
                                                             ids=[[c[-1] for c in GEMV_CASES], None, None]))
def test_gemv_gated(T, F, K, tune, path, bias, fn):
    _, scratch = _case("gemv_gated", "decode", T, F, K, tune, fn, bias)
    assert (len(scratch) > 0) == ("split" in path)


@pytest.mark.parametrize("fn", ACTS)
def test_gemv_gated_every_activation(fn):
    _case("gemv_gated", "decode", 1, 50, 72, {"BLOCK_N": 16, "FMA_BLOCK_K": 32, "SPLIT_K": 2}, fn, False)


@pytest.mark.parametrize("T,B,tune", [(2, 1, {}), (17, 3, {}), (64, 5, {}),
                                      (17, 3, {"BLOCK_N_DOT": 32, "BLOCK_K": 32, "BLOCK_T": 16, "SPLIT_K_DOT": 4})])
def test_gemv_gated_short_rows(T, B, tune):
    """Short prefill steps run the GEMV with T > B rows, from dim:T only."""
    k, _ = _case("gemv_gated", "short", T, 68, 136, tune, "silu", False, B=B)
    assert '"dim:T"' in k.source and "meta:" not in k.source


# (T, F, K, tune, splits)
GEMM_CASES = [
    (1, 50, 72, {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32}, 1),
    (17, 50, 72, {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2}, 1),
    (70, 65, 200, {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 2}, 1),
    (37, 65, 200, {}, 1),
    (50, 50, 300, {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "SPLIT_K": 3, "TARGET_CTAS": 1000}, 3),
]


@pytest.mark.parametrize("T,F,K,tune,splits,bias,fn", pairwise(
    GEMM_CASES, [False, True], ["silu", "gelu"],
    ids=[[f"{T}-{F}-{K}-tune{i}-{s}" for i, (T, F, K, _, s) in enumerate(GEMM_CASES)], None, None]))
def test_gemm_gated(T, F, K, tune, splits, bias, fn):
    from infc.compiler.contract.bind import grid
    k, _ = _case("gemm_gated", "prefill", T, F, K, tune, fn, bias)
    assert grid(k.meta, {"T": T, "B": 1})[1] == splits


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("over,loop", [({"NUM_SMS": 3}, "tma persistent"), ({"PERSISTENT": 0}, "tma"),
                                       ({"TMA": 0}, "pointers")])
def test_gemm_gated_tile_loops(over, loop, bias):
    """The gated tile (gate rows, then their up rows) through each form of the tile loop: a TMA
    box of W seen as [2, F, K], persistent or not, and pointer loads."""
    k, _ = _case("gemm_gated", "prefill", 45, 70, 96, {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, **over},
                 "silu", bias)
    assert ("make_tensor_descriptor" in k.source) == (loop != "pointers")


@pytest.mark.parametrize("fn", ACTS)
def test_gemm_gated_every_activation(fn):
    _case("gemm_gated", "prefill", 17, 50, 72, {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32}, fn, True)


def _exact_inputs(T, F, K, gen):
    """x and w on grids coarse enough that every sum over K is exact in fp32 whatever its order:
    the kernel's g and u are then known exactly, and only the epilogue's roundings remain."""
    x = gen.integers(-16, 17, (T, K)) / 16.0
    w = gen.integers(-8, 9, (2 * F, K)) / 64.0
    return torch.tensor(x, dtype=torch.bfloat16), torch.tensor(w, dtype=torch.bfloat16)


@pytest.mark.parametrize("fn", ["silu", "gelu", "gelu_tanh", "sigmoid"])
@pytest.mark.parametrize("template,phase,T,tune", [
    ("gemv_gated", "decode", 1, {"BLOCK_N": 16, "FMA_BLOCK_K": 32, "SPLIT_K": 2}),
    ("gemv_gated", "decode", 20, {"BLOCK_N_DOT": 32, "BLOCK_K": 32, "BLOCK_T": 16}),
    ("gemm_gated", "prefill", 40, {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32}),
])
def test_gated_epilogue_rounds_as_hf(template, phase, T, tune, fn):
    """HF's MLP: g and u are bf16 outputs of the projections, act(g) is rounded to bf16, then
    act(g) * u is. With exact sums the kernel must give that, not one rounding of act(g) * u."""
    F, K = 160, 64
    x, w = _exact_inputs(T, F, K, np.random.default_rng(T))
    k = _render(template, phase, F, K, fn, False, tune)
    y = poison((T, F))
    run(k, {"in:0": x, "in:1": w, "out:0": y}, {"T": T, "B": 1})
    gu = f32(x).astype(np.float64) @ f32(w).astype(np.float64).T
    g, u = bf16(gu[:, :F]).astype(np.float64), bf16(gu[:, F:]).astype(np.float64)
    a = ACTIVATIONS[fn](g)
    hf, once = bf16(bf16(a) * u), bf16(a * u)
    # (>= 0.97: the fp32 activations lose relative precision in their tails, where float64's
    # value rounds the other way now and then)
    assert (f32(y) == hf).mean() >= 0.97
    assert (f32(y) == once).mean() < 0.92


def test_gated_weight_rows_must_pair():
    with pytest.raises(TemplateError, match="even"):
        _render("gemv_gated", "decode", 50, 72, "silu", False, {"BLOCK_N": 15})
