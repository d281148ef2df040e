"""The wide phase's linears (decode steps of many sequences, compiler/passes/select_kernels.py)
under the interpreter, against their ops' numpy references: the gated GEMV and lm_head_last with
the template's wide row tiles (BLOCK_T 64 by default) and the tuned 128-row tiles, and the plain
linears on the GEMM's decode tiles, over row counts the tiles do not divide, with N and K not
multiples of the column and K blocks, split-K included (its counters left zero)."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from infc.compiler.ops import REGISTRY

from .harness import poison, rand, rel_err, render, run
from .test_gemm_kernels import TOL, check_scratch_zero, f32


def test_the_wide_phase_renders_64_row_tiles():
    args = ([("x", ["T", 72], "bf16"), ("w", [100, 72], "bf16", "weight")], [("y", ["T", 100], "bf16")])
    assert render("gemv", "linear", *args, phase="wide").meta["constexprs"]["BLOCK_T"] == 64
    assert render("gemv", "linear", *args, phase="decode").meta["constexprs"]["BLOCK_T"] == 32
    assert render("gemv", "linear", *args, phase="wide", tune={"BLOCK_T": 128}).meta["constexprs"]["BLOCK_T"] == 128


# (T, N, K, tune): 130 rows = two 64-row blocks and a 2-row one; 100 rows split K in two per row
# block (SPLIT_K_DOT 4 over 2 row blocks); 129 = one 128-row block and 1 row
WIDE_CASES = [
    (130, 100, 136, {}),
    (100, 100, 136, {"BLOCK_N_DOT": 32, "BLOCK_K": 32, "FMA_BLOCK_K": 32, "SPLIT_K_DOT": 4}),
    (129, 96, 200, {"BLOCK_T": 128, "BLOCK_N_DOT": 32, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}),
]


@pytest.mark.parametrize("T,N,K,tune", WIDE_CASES)
def test_wide_gemv(T, N, K, tune):
    gen = np.random.default_rng(T + N + K)
    x, w = rand((T, K), gen=gen), rand((N, K), gen=gen, scale=K ** -0.5)
    k = render("gemv", "linear", [("x", ["T", K], "bf16"), ("w", [N, K], "bf16", "weight")],
               [("y", ["T", N], "bf16")], phase="wide", tune=tune)
    y = poison((T, N))
    scratch = run(k, {"in:0": x, "in:1": w, "out:0": y}, {"T": T, "B": T})
    check_scratch_zero(scratch)
    assert (len(scratch) > 0) == ("SPLIT_K_DOT" in tune)
    assert rel_err(f32(y), REGISTRY["linear"].reference(None, f32(x), f32(w))) <= TOL


@pytest.mark.parametrize("T,N,K,tune", WIDE_CASES)
def test_wide_gemv_gated(T, N, K, tune):
    F = N // 2
    gen = np.random.default_rng(T * 7 + K)
    x, w = rand((T, K), gen=gen), rand((2 * F, K), gen=gen, scale=2 * K ** -0.5)
    k = render("gemv_gated", "linear_gated", [("x", ["T", K], "bf16"), ("w", [2 * F, K], "bf16", "weight")],
               [("y", ["T", F], "bf16")], attrs={"fn": "silu", "has_bias": False}, phase="wide", tune=tune)
    y = poison((T, F))
    check_scratch_zero(run(k, {"in:0": x, "in:1": w, "out:0": y}, {"T": T, "B": T}))
    want = REGISTRY["linear_gated"].reference(None, f32(x), f32(w), fn="silu", has_bias=False)
    assert rel_err(f32(y), want) <= TOL


@pytest.mark.parametrize("B,tune", [(70, {}), (129, {"BLOCK_T": 128, "BLOCK_N_DOT": 32, "num_warps": 8})])
def test_wide_lm_head_last(B, tune):
    """A wide step's last rows are all of them (one token a sequence): B = T."""
    T, V, H = B, 90, 136
    gen = np.random.default_rng(B)
    x, d = rand((T, H), gen=gen), rand((T, H), gen=gen)
    norm, w = rand((H,), gen=gen, scale=0.3) + 1.0, rand((V, H), gen=gen, scale=H ** -0.5)
    last = np.arange(B, dtype=np.int32)
    attrs = {"eps": 1e-6, "residual": True, "softcap": None, "has_bias": False}
    k = render("lm_head_last", "lm_head_last",
               [("x", ["T", H], "bf16"), ("d", ["T", H], "bf16"), ("norm", [H], "bf16", "weight"),
                ("w", [V, H], "bf16", "weight")], [("logits", ["B", V], "f32")], attrs=attrs,
               phase="wide", tune=tune)
    out = poison((B, V), "f32")
    run(k, {"in:0": x, "in:1": d, "in:2": norm, "in:3": w, "out:0": out,
            "meta:last_rows": torch.from_numpy(last)}, {"T": T, "B": B})
    want = REGISTRY["lm_head_last"].reference(SimpleNamespace(last_rows=last.astype(np.int64)),
                                              f32(x), f32(d), f32(norm), f32(w), **attrs)
    assert rel_err(out.numpy(), want) <= TOL


def test_the_wide_phase_runs_plain_linears_on_gemm_decode_tiles():
    """A wide step's plain linear is the GEMM with its decode tiles: 64 x 128 by TMA, one program a
    tile, 8 stages, 4 warps, a programmatic dependent of the launch before it; prefill keeps its
    persistent 128-row tiles and launches plainly."""
    from infc.compiler.ops import REGISTRY as R
    assert R["linear"].template("triton", "wide") == "gemm"
    assert R["linear_gated"].template("triton", "wide") == "gemv_gated"
    args = ([("x", ["T", 2560], "bf16"), ("w", [2560, 4096], "bf16", "weight")], [("y", ["T", 2560], "bf16")])
    wide, prefill = render("gemm", "linear", *args, phase="wide"), render("gemm", "linear", *args, phase="prefill")
    c = wide.meta["constexprs"]
    assert (c["BLOCK_M"], c["BLOCK_N"], wide.meta["num_stages"], wide.meta["num_warps"]) == (64, 128, 8, 4)
    assert wide.meta.get("pdl") and c["PDL"] and "gdc_wait" in wide.source and "flatten=True" not in wide.source
    assert not prefill.meta.get("pdl") and "PDL" not in prefill.meta["constexprs"]
    assert prefill.meta["constexprs"]["BLOCK_M"] == 128 and "flatten=True" in prefill.source


# (T, N, K, tune): rows that the 64- and 128-row tiles do not divide, N not a multiple of the
# column tile, K not of BLOCK_K (TMA reads zeros past each edge); the 128-row qkv entry's form
WIDE_GEMM_CASES = [
    (130, 200, 136, {}),
    (129, 72, 96, {"BLOCK_M": 128, "num_warps": 8, "num_stages": 6}),
    (65, 144, 200, {"BLOCK_N": 64, "num_stages": 12}),
]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("T,N,K,tune", WIDE_GEMM_CASES)
def test_wide_gemm(T, N, K, tune, bias):
    gen = np.random.default_rng(T * 3 + N + K)
    arrays = [rand((T, K), gen=gen), rand((N, K), gen=gen, scale=K ** -0.5)]
    inputs = [("x", ["T", K], "bf16"), ("w", [N, K], "bf16", "weight")]
    if bias:
        arrays.append(rand((N,), gen=gen, scale=0.3))
        inputs.append(("b", [N], "bf16", "weight"))
    k = render("gemm", "linear", inputs, [("y", ["T", N], "bf16")], attrs={"has_bias": bias}, phase="wide",
               tune=tune)
    assert "make_tensor_descriptor" in k.source
    y = poison((T, N))
    check_scratch_zero(run(k, {f"in:{i}": a for i, a in enumerate(arrays)} | {"out:0": y}, {"T": T, "B": T}))
    want = REGISTRY["linear"].reference(None, *[f32(a) for a in arrays], has_bias=bias)
    assert rel_err(f32(y), want) <= TOL
