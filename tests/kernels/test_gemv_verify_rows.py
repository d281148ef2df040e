"""A verify program's GEMVs on the CUDA-core rows (issue 43; codegen_templates/triton/gemv.py.j2
VERIFY_ROWS, a tune entry's FMA_T "rows": a bf16 verify launch's default is the tensor-core path,
VERIFY_DOT, tests/test_verify_program.py): a speculative build's k + 1 rows on the CUDA-core path together, each W tile read once for all R
rows (ROW_SUMS "lanes": each tile's products summed within a thread, across threads after the
loop; "tile", a tuning choice: reduced across threads per tile), with no
tensor-core path in the kernel. Under the interpreter against the ops' numpy references: plain,
gated, act_mul, lm_head_last, the merged add_rms_norm prologue (plain and gated) and quantized W, R in
{2, 5, 8}, a step of fewer live rows than R (the rest masked), N and K not multiples of the
tiles, split-K (its counters left zero)."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from infc.compiler.ops import REGISTRY

from exhaustive import EXHAUSTIVE

from .harness import poison, rand, rel_err, render, run
from .test_gemm_kernels import TOL, check_scratch_zero, f32
from .test_gemv_prologue import PROLOGUE, _inputs, _tensors, _want_h

# (R: the verify rows the kernel is rendered for, T: the step's live rows): R in {2, 5, 8}, full
# and masked steps (T < R); each template runs one of them in the fast suite, the rest with
# --exhaustive
CASES = [(2, 2), (5, 3), (8, 7), (2, 1), (5, 5), (8, 8)]


def rows(fast):
    return [pytest.param(r, t, id=f"R{r}-T{t}", marks=() if (r, t) == fast else EXHAUSTIVE) for r, t in CASES]


# 100 x 200: two 16-row blocks short of the tile, K three 64-deep tiles with a ragged last one
# (two preloaded, one in the loop); SPLIT_K 2 on 96 x 1100 (two 256-deep K ranges a program)
TUNE = {"FMA_BLOCK_K": 64, "BLOCK_N": 16, "FMA_T": "rows"}
SPLIT = {"FMA_BLOCK_K": 256, "SPLIT_K": 2, "FMA_T": "rows"}


def _cuda_core_only(k, R):
    """The kernel is the multi-row CUDA-core form: R rows on it, no tensor-core path."""
    assert k.meta["constexprs"]["FMA_T"] == R and k.meta["constexprs"]["FMA_ROWS"] == R
    assert "tl.dot(" not in k.source
    assert "tl.sum(tl.reshape(wf * a" in k.source          # ROW_SUMS "lanes"
    assert "if M > 1:" in k.source                         # dead rows skip their FMAs


@pytest.mark.parametrize("R,T", rows((5, 3)))
def test_plain_verify_gemv(R, T):
    N, K = 100, 200
    gen = np.random.default_rng(R * 10 + T)
    x, w = rand((T, K), gen=gen), rand((N, K), gen=gen, scale=K ** -0.5)
    k = render("gemv", "linear", [("x", ["T", K], "bf16"), ("w", [N, K], "bf16", "weight")],
               [("y", ["T", N], "bf16")], attrs={"has_bias": False}, narrow=R, tune=TUNE)
    _cuda_core_only(k, R)
    y = poison((T, N))
    run(k, {"in:0": x, "in:1": w, "out:0": y}, {"T": T, "B": T})
    assert rel_err(f32(y), REGISTRY["linear"].reference(None, f32(x), f32(w))) <= TOL


@pytest.mark.parametrize("sums", ["tile", "end", "chain"])
def test_verify_gemv_row_sums_forms(sums):
    """The tuner's other row-sum forms (the default is "lanes"): the same outputs on a masked
    step, K ragged against the tile."""
    N, K, R, T = 100, 200, 5, 3
    gen = np.random.default_rng(len(sums))
    x, w = rand((T, K), gen=gen), rand((N, K), gen=gen, scale=K ** -0.5)
    k = render("gemv", "linear", [("x", ["T", K], "bf16"), ("w", [N, K], "bf16", "weight")],
               [("y", ["T", N], "bf16")], attrs={"has_bias": False}, narrow=R, tune={**TUNE, "ROW_SUMS": sums})
    assert "tl.reshape(wf * a" not in k.source and ("tl.sum(wf * a" in k.source) == (sums == "tile")
    assert ("= _lanes_fma(acc" in k.source) == (sums == "chain")
    y = poison((T, N))
    run(k, {"in:0": x, "in:1": w, "out:0": y}, {"T": T, "B": T})
    assert rel_err(f32(y), REGISTRY["linear"].reference(None, f32(x), f32(w))) <= TOL


@pytest.mark.parametrize("R,T", [pytest.param(5, 4, id="R5-T4"),
                                 pytest.param(8, 7, id="R8-T7", marks=EXHAUSTIVE)])
def test_plain_verify_gemv_split_k_with_bias(R, T):
    N, K = 96, 1100
    gen = np.random.default_rng(R + T)
    x, w, b = rand((T, K), gen=gen), rand((N, K), gen=gen, scale=K ** -0.5), rand((N,), gen=gen)
    k = render("gemv", "linear", [("x", ["T", K], "bf16"), ("w", [N, K], "bf16", "weight"), ("b", [N], "bf16", "weight")],
               [("y", ["T", N], "bf16")], attrs={"has_bias": True}, narrow=R, tune=SPLIT)
    _cuda_core_only(k, R)
    y = poison((T, N))
    check_scratch_zero(run(k, {"in:0": x, "in:1": w, "in:2": b, "out:0": y}, {"T": T, "B": T}))
    want = REGISTRY["linear"].reference(None, f32(x), f32(w), f32(b), has_bias=True)
    assert rel_err(f32(y), want) <= TOL


@pytest.mark.parametrize("R,T", rows((8, 7)))
def test_gated_verify_gemv(R, T):
    F, K = 50, 200
    gen = np.random.default_rng(3 * R + T)
    x, w = rand((T, K), gen=gen), rand((2 * F, K), gen=gen, scale=K ** -0.5)
    k = render("gemv_gated", "linear_gated", [("x", ["T", K], "bf16"), ("w", [2 * F, K], "bf16", "weight")],
               [("y", ["T", F], "bf16")], attrs={"fn": "silu", "has_bias": False}, narrow=R, tune=TUNE)
    _cuda_core_only(k, R)
    y = poison((T, F))
    run(k, {"in:0": x, "in:1": w, "out:0": y}, {"T": T, "B": T})
    want = REGISTRY["linear_gated"].reference(None, f32(x), f32(w), fn="silu", has_bias=False)
    assert rel_err(f32(y), want) <= TOL


@pytest.mark.parametrize("R,T", rows((2, 2)))
def test_act_mul_verify_gemv(R, T):
    N, K = 100, 200
    gen = np.random.default_rng(5 * R + T)
    gu, w = rand((T, 2 * K), gen=gen), rand((N, K), gen=gen, scale=K ** -0.5)
    k = render("gemv_act_mul", "linear_act_mul", [("gu", ["T", 2 * K], "bf16"), ("w", [N, K], "bf16", "weight")],
               [("y", ["T", N], "bf16")], attrs={"fn": "silu", "has_bias": False}, narrow=R, tune=TUNE)
    _cuda_core_only(k, R)
    y = poison((T, N))
    run(k, {"in:0": gu, "in:1": w, "out:0": y}, {"T": T, "B": T})
    want = REGISTRY["linear_act_mul"].reference(None, f32(gu), f32(w), fn="silu", has_bias=False)
    assert rel_err(f32(y), want) <= TOL


@pytest.mark.parametrize("R,T,gated", [pytest.param(5, 3, False, id="plain-R5-T3"),
                                       pytest.param(8, 8, False, id="plain-R8-T8", marks=EXHAUSTIVE),
                                       pytest.param(2, 1, True, id="gated-R2-T1", marks=EXHAUSTIVE),
                                       pytest.param(5, 4, True, id="gated-R5-T4", marks=EXHAUSTIVE)])
def test_verify_gemv_with_add_rms_norm_prologue(R, T, gated):
    """The merged prologue: every row's rstd from its own row pass, s written once per row."""
    N, K = (100, 1100) if gated else (96, 1100)
    cols = N // 2 if gated else N
    x, d, norm, w = _inputs(cols, K, "bf16", N, R + T + gated, T)
    tpl, op = ("gemv_gated", "linear_gated") if gated else ("gemv", "linear")
    attrs = {"fn": "silu", "has_bias": False} if gated else {"has_bias": False}
    k = render(tpl, op, *_tensors(K, N, cols, "bf16"), attrs=attrs, narrow=R,
               tune={"BLOCK_N": 32, "FMA_BLOCK_K": 128, "FMA_T": "rows"} if gated else SPLIT, prologue=PROLOGUE)
    _cuda_core_only(k, R)
    res, y = poison((T, K)), poison((T, cols))
    check_scratch_zero(run(k, {"in:0": x, "in:1": d, "in:2": norm, "in:3": w, "out:0": res, "out:1": y},
                           {"T": T, "B": T}))
    s, h = _want_h(x, d, norm, "bf16")
    assert np.array_equal(f32(res), s)
    want = REGISTRY[op].reference(None, h, f32(w), **({"fn": "silu", "has_bias": False} if gated else {}))
    assert rel_err(f32(y), want) <= TOL


def test_lm_head_last_verify_rows():
    """lm_head_last's B rows (one a verify row) on the same form: the norm's sums per row."""
    R, B, T, V, K = 5, 4, 6, 70, 200
    gen = np.random.default_rng(11)
    x, norm, w = rand((T, K), gen=gen), rand((K,), gen=gen, scale=0.3), rand((V, K), gen=gen, scale=K ** -0.5)
    rows = np.array([5, 0, 3, 2], np.int32)
    k = render("lm_head_last", "lm_head_last", [("x", ["T", K], "bf16"), ("norm", [K], "bf16", "weight"),
                                                ("w", [V, K], "bf16", "weight")],
               [("logits", ["B", V], "f32")], attrs={"eps": 1e-6, "has_bias": False, "residual": False},
               narrow=R, tune={"BLOCK_N": 16, "FMA_BLOCK_K": 64, "FMA_T": "rows"})
    _cuda_core_only(k, R)
    y = poison((B, V), "f32")
    run(k, {"in:0": x, "in:1": norm, "in:2": w, "out:0": y, "meta:last_rows": torch.from_numpy(rows)},
        {"T": T, "B": B})
    want = REGISTRY["lm_head_last"].reference(SimpleNamespace(last_rows=rows.astype(np.int64)), f32(x), f32(norm),
                                              f32(w), eps=1e-6, has_bias=False, residual=False, softcap=None)
    assert rel_err(y.numpy(), want) <= TOL


@pytest.mark.parametrize("case", ["gated-prologue", "lm_head_last", "u8-g64", "fk8"])
def test_chain_row_sums_on_every_form(case):
    """ROW_SUMS "chain" (a run's products one FFMA chain from the row's sums: _lanes_fma) on the
    merged prologue's gated kernel, lm_head_last's norm rows, a quantized W, and a tile of 8
    columns (one run): the references' outputs."""
    R, T = 5, 4
    chain = {"ROW_SUMS": "chain", "FMA_T": "rows"}
    if case == "u8-g64":                 # (u4 codes take W4_FORM's loops, not these sums)
        from .test_quant_linear_kernels import SCHEMES, _case
        k, _, _ = _case("gemv", SCHEMES[case], "plain", 3, {"BLOCK_N": 16, "FMA_BLOCK_K": 128, **chain}, "decode",
                        7, narrow=R)
        assert "= _lanes_fma(acc" in k.source
        return
    if case == "lm_head_last":
        B, V, K = 4, 70, 200
        gen = np.random.default_rng(12)
        x, norm, w = rand((T + 2, K), gen=gen), rand((K,), gen=gen, scale=0.3), rand((V, K), gen=gen, scale=K ** -0.5)
        rows_ = np.array([5, 0, 3, 2], np.int32)
        k = render("lm_head_last", "lm_head_last", [("x", ["T", K], "bf16"), ("norm", [K], "bf16", "weight"),
                                                    ("w", [V, K], "bf16", "weight")],
                   [("logits", ["B", V], "f32")], attrs={"eps": 1e-6, "has_bias": False, "residual": False},
                   narrow=R, tune={"BLOCK_N": 16, "FMA_BLOCK_K": 64, **chain})
        assert "= _lanes_fma(acc" in k.source
        y = poison((B, V), "f32")
        run(k, {"in:0": x, "in:1": norm, "in:2": w, "out:0": y, "meta:last_rows": torch.from_numpy(rows_)},
            {"T": T + 2, "B": B})
        want = REGISTRY["lm_head_last"].reference(SimpleNamespace(last_rows=rows_.astype(np.int64)), f32(x),
                                                  f32(norm), f32(w), eps=1e-6, has_bias=False, residual=False,
                                                  softcap=None)
        assert rel_err(y.numpy(), want) <= TOL
        return
    if case == "fk8":
        N, K = 40, 100
        gen = np.random.default_rng(13)
        x, w = rand((T, K), gen=gen), rand((N, K), gen=gen, scale=K ** -0.5)
        k = render("gemv", "linear", [("x", ["T", K], "bf16"), ("w", [N, K], "bf16", "weight")],
                   [("y", ["T", N], "bf16")], attrs={"has_bias": False}, narrow=R,
                   tune={"BLOCK_N": 16, "FMA_BLOCK_K": 8, **chain})
        assert "= _lanes_fma(acc" in k.source
        y = poison((T, N))
        run(k, {"in:0": x, "in:1": w, "out:0": y}, {"T": T, "B": T})
        assert rel_err(f32(y), REGISTRY["linear"].reference(None, f32(x), f32(w))) <= TOL
        return
    N, K = 100, 1100
    x, d, norm, w = _inputs(N // 2, K, "bf16", N, R + T + 1, T)
    k = render("gemv_gated", "linear_gated", *_tensors(K, N, N // 2, "bf16"), attrs={"fn": "silu", "has_bias": False},
               narrow=R, tune={"BLOCK_N": 32, "FMA_BLOCK_K": 128, **chain}, prologue=PROLOGUE)
    assert "= _lanes_fma(acc" in k.source
    res, y = poison((T, K)), poison((T, N // 2))
    check_scratch_zero(run(k, {"in:0": x, "in:1": d, "in:2": norm, "in:3": w, "out:0": res, "out:1": y},
                           {"T": T, "B": T}))
    s, h = _want_h(x, d, norm, "bf16")
    assert np.array_equal(f32(res), s)
    want = REGISTRY["linear_gated"].reference(None, h, f32(w), fn="silu", has_bias=False)
    assert rel_err(f32(y), want) <= TOL


def test_the_verify_form_is_the_one_row_kernels_otherwise():
    """The one-token narrow kernel keeps its one-row sums (ROW_SUMS "end"); a verify launch takes
    the tensor-core path for its rows by default (VERIFY_DOT) or when tuned FMA_T 1, and the
    CUDA-core rows when tuned FMA_T "rows" or a row count."""
    args = ([("x", ["T", 72], "bf16"), ("w", [100, 72], "bf16", "weight")], [("y", ["T", 100], "bf16")])
    one = render("gemv", "linear", *args, narrow=True)
    assert "tl.dot(" not in one.source and "tl.sum(wf * a" not in one.source
    assert one.meta["constexprs"]["FMA_T"] == 1
    for tune in ({}, {"FMA_T": 1}):
        dot = render("gemv", "linear", *args, narrow=5, tune=tune)
        assert "tl.dot(" in dot.source and dot.meta["constexprs"]["FMA_ROWS"] == 1
    for rows_ in ("rows", 5):
        k = render("gemv", "linear", *args, narrow=5, tune={"FMA_T": rows_})
        assert "tl.dot(" not in k.source and k.meta["constexprs"]["FMA_T"] == 5
    # a verify tile holds at most VERIFY_TILE (4096) elements: the one-row 16 x 512 tile halves in K
    tile = {"BLOCK_N": 16, "FMA_BLOCK_K": 512}
    assert render("gemv", "linear", *args, narrow=5, tune=tile).meta["constexprs"]["FMA_BLOCK_K"] == 256
    assert render("gemv", "linear", *args, narrow=5, tune={**tile, "VERIFY_TILE": 8192}).meta["constexprs"]["FMA_BLOCK_K"] == 512
    assert render("gemv", "linear", *args, narrow=True, tune=tile).meta["constexprs"]["FMA_BLOCK_K"] == 512
    ends = render("gemv", "linear", *args, narrow=5, tune={"ROW_SUMS": "end", "FMA_T": "rows"})
    assert "tl.dot(" not in ends.source and "tl.sum(wf * a" not in ends.source
    assert ends.meta["constexprs"]["FMA_T"] == 5


# quantized W on the verify form (tests/kernels/test_quant_linear_kernels.py's schemes and checks):
# fp8 codes go the elementwise CUDA-core loop (the narrow codes path is one row's), u4 its W4 loop;
# fast: an fp8 with dynamic activation groups; the rest (a packed u4 with zero points on its W4 loop,
# per-token fp8, u8, the gated and prologue forms) with --exhaustive
QUANT_FAST = {("fp8-32x64-group64", "plain")}


@pytest.mark.parametrize("scheme,mode", [
    pytest.param(s, m, id=f"{s}-{m}", marks=() if (s, m) in QUANT_FAST else EXHAUSTIVE)
    for s in ("fp8-32x64-group64", "fp8-channel-token", "u4-g32-zero", "u8-g64") for m in ("plain", "gated", "prologue")])
def test_quantized_verify_gemv(scheme, mode):
    from .test_quant_linear_kernels import SCHEMES, _case
    k, _, _ = _case("gemv", SCHEMES[scheme], mode, 3, {"BLOCK_N": 16, "FMA_BLOCK_K": 128}, "decode",
                    len(scheme) + len(mode), narrow=5)
    assert k.meta["constexprs"]["FMA_T"] == 5 and "tl.dot(" not in k.source
