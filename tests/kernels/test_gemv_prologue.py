"""The narrow phase's merged launch (compiler/passes/merge_prologues.py): add_rms_norm(x, d, norm)
in front of the GEMV, plain and gated, under the interpreter against the two ops' references.
One decode token (the CUDA-core path) and 5 / 8 rows (a speculative verify step's k + 1
rows: the CUDA-core path's rows together; tests/kernels/test_gemv_verify_rows.py has more), N and K not multiples of the column and K tiles, K
longer than the prologue's 1024-wide row chunks, split-K (its counters left zero), bf16 and f32
norm weights (Llama's and Gemma's roundings)."""
import numpy as np
import pytest
import torch

from infc.compiler.codegen.render import TemplateError
from infc.compiler.ops import REGISTRY

from exhaustive import EXHAUSTIVE

from .harness import bf16, poison, rand, rel_err, render, run
from .test_gemm_kernels import TOL, check_scratch_zero, f32

EPS = 1e-6
PROLOGUE = {"op": "add_rms_norm", "inputs": 3, "output": 1, "value": "h", "writes": 1, "attrs": {"eps": EPS}}

# (N, K, norm dtype, tune): K = 200 is 3 FMA tiles of 64 with a ragged last one (2 preloaded, 1
# in the loop); 1100 takes two row chunks of 1024 in the prologue and SPLIT_K 2 (each split's
# program re-reads the whole row); 72 x 40 is smaller than one tile
CASES = [
    (100, 200, "bf16", {"FMA_BLOCK_K": 64, "BLOCK_N": 16}),
    (96, 1100, "bf16", {"FMA_BLOCK_K": 256, "SPLIT_K": 2}),
    (40, 72, "f32", {"FMA_BLOCK_K": 32}),
    (130, 1100, "f32", {}),
]


def _inputs(N, K, norm_dtype, rows, seed, T=1):
    gen = np.random.default_rng(seed)
    x, d = rand((T, K), gen=gen), rand((T, K), gen=gen, scale=0.5)
    norm = rand((K,), norm_dtype, gen=gen, scale=0.3)
    if norm_dtype == "f32":
        norm = norm + 1.0                      # Gemma's 1 + w, kept in f32
    w = rand((rows, K), gen=gen, scale=K ** -0.5)
    return x, d, norm, w


def _want_h(x, d, norm, norm_dtype):
    s = f32(x) + f32(d)
    s = bf16(s)                                # the residual stream is stored in bf16
    _, h = REGISTRY["add_rms_norm"].reference(None, f32(x), f32(d), f32(norm), eps=EPS)
    return s, h


def _tensors(K, rows, out_cols, norm_dtype):
    ins = [("x", ["T", K], "bf16"), ("d", ["T", K], "bf16"), ("norm", [K], norm_dtype, "weight"),
           ("w", [rows, K], "bf16", "weight")]
    outs = [("res", ["T", K], "bf16"), ("y", ["T", out_cols], "bf16")]
    return ins, outs


# rows: 1 (CUDA-core path) for every case, 5 and 8 (a verify program's rows, each its own row pass)
# for each with --exhaustive, the split one at 8 rows in the fast suite (and the gated below)
ROWS = [pytest.param(*c, 1, id=f"{c[0]}-{c[1]}-1") for c in CASES] + \
    [pytest.param(*c, t, id=f"{c[0]}-{c[1]}-{t}", marks=() if (i, t) == (1, 8) else EXHAUSTIVE)
     for i, c in enumerate(CASES) for t in (5, 8)]


@pytest.mark.parametrize("N,K,norm_dtype,tune,T", ROWS)
def test_gemv_with_add_rms_norm_prologue(N, K, norm_dtype, tune, T):
    x, d, norm, w = _inputs(N, K, norm_dtype, N, N + K, T)
    k = render("gemv", "linear", *_tensors(K, N, N, norm_dtype), attrs={"has_bias": False},
               narrow=8 if T > 1 else True, tune=tune, prologue=PROLOGUE)
    assert [p[2] for p in k.meta["params"][:6]] == ["in:0", "in:1", "in:2", "out:0", "in:3", "out:1"]
    res, y = poison((T, K)), poison((T, N))
    scratch = run(k, {"in:0": x, "in:1": d, "in:2": norm, "in:3": w, "out:0": res, "out:1": y}, {"T": T, "B": T})
    check_scratch_zero(scratch)
    s, h = _want_h(x, d, norm, norm_dtype)
    assert np.array_equal(f32(res), s)         # exactly add_rms_norm's residual
    assert rel_err(f32(y), REGISTRY["linear"].reference(None, h, f32(w))) <= TOL


# the last: the H200 table's narrow gate|up tile (32 rows x 128 deep, 4 warps) on a ragged K
@pytest.mark.parametrize("N,K,norm_dtype,tune,T", [(*c, 1) for c in CASES[:2]] + [
    (100, 1100, "bf16", {"BLOCK_N": 32, "FMA_BLOCK_K": 128, "num_warps": 4}, 1),
    (100, 1100, "bf16", {"BLOCK_N": 32, "FMA_BLOCK_K": 128, "num_warps": 4}, 5)])
def test_gated_gemv_with_add_rms_norm_prologue(N, K, norm_dtype, tune, T):
    F = N // 2
    x, d, norm, w = _inputs(F, K, norm_dtype, 2 * F, 3 * K + F, T)
    k = render("gemv_gated", "linear_gated", *_tensors(K, 2 * F, F, norm_dtype),
               attrs={"fn": "silu", "has_bias": False}, narrow=8 if T > 1 else True, tune=tune,
               prologue=PROLOGUE)
    res, y = poison((T, K)), poison((T, F))
    check_scratch_zero(run(k, {"in:0": x, "in:1": d, "in:2": norm, "in:3": w, "out:0": res, "out:1": y},
                           {"T": T, "B": T}))
    s, h = _want_h(x, d, norm, norm_dtype)
    assert np.array_equal(f32(res), s)
    want = REGISTRY["linear_gated"].reference(None, h, f32(w), fn="silu", has_bias=False)
    assert rel_err(f32(y), want) <= TOL


def test_the_prologue_matches_the_unmerged_kernels_bit_for_bit_mostly():
    """The merged launch against add_rms_norm's kernel then the narrow GEMV: the same roundings, so
    the outputs differ only where the row sum's order moves rstd by an ulp (rare flips of one
    bf16 step)."""
    N, K = 96, 1100
    x, d, norm, w = _inputs(N, K, "bf16", N, 5)
    merged = render("gemv", "linear", *_tensors(K, N, N, "bf16"), attrs={"has_bias": False},
                    narrow=True, prologue=PROLOGUE)
    res, y = poison((1, K)), poison((1, N))
    run(merged, {"in:0": x, "in:1": d, "in:2": norm, "in:3": w, "out:0": res, "out:1": y}, {"T": 1, "B": 1})
    norm_k = render("add_rms_norm", "add_rms_norm", [("x", ["T", K], "bf16"), ("d", ["T", K], "bf16"),
                                                     ("norm", [K], "bf16", "weight")],
                    [("res", ["T", K], "bf16"), ("h", ["T", K], "bf16")], attrs={"eps": EPS})
    res2, h2 = poison((1, K)), poison((1, K))
    run(norm_k, {"in:0": x.clone(), "in:1": d, "in:2": norm, "out:0": res2, "out:1": h2}, {"T": 1, "B": 1})
    plain = render("gemv", "linear", [("h", ["T", K], "bf16"), ("w", [N, K], "bf16", "weight")],
                   [("y", ["T", N], "bf16")], attrs={"has_bias": False}, narrow=True)
    y2 = poison((1, N))
    run(plain, {"in:0": h2, "in:1": w, "out:0": y2}, {"T": 1, "B": 1})
    assert torch.equal(res, res2)
    assert (y == y2).float().mean() >= 0.97


def test_the_narrow_gemv_takes_the_cuda_core_path_at_one_row_only():
    args = ([("x", ["T", 72], "bf16"), ("w", [100, 72], "bf16", "weight")], [("y", ["T", 100], "bf16")])
    assert "tl.dot(" in render("gemv", "linear", *args).source
    # a one-token narrow program: the CUDA-core path alone; a speculative build's verify program
    # (8 rows) the tensor-core path for its rows (VERIFY_DOT), unless its entry sets FMA_T "rows":
    # then its rows together on the CUDA-core path (tests/kernels/test_gemv_verify_rows.py)
    one = render("gemv", "linear", *args, narrow=True)
    assert "tl.dot(" not in one.source and one.meta["constexprs"]["FMA_ROWS"] == 1
    verify = render("gemv", "linear", *args, narrow=8, tune={"FMA_T": "rows"})
    assert "tl.dot(" not in verify.source and verify.meta["constexprs"]["FMA_ROWS"] == 8
    narrow = render("gemv", "linear", *args, narrow=8)
    assert "tl.dot(" in narrow.source and narrow.meta["constexprs"]["FMA_ROWS"] == 1
    # an fp32 output (a row-parallel rank's partials) keeps the tensor-core path in every phase
    f32_out = ([("x", ["T", 72], "bf16"), ("w", [100, 72], "bf16", "weight")], [("y", ["T", 100], "f32")])
    assert "tl.dot(" in render("gemv", "linear", *f32_out, attrs={"out_dtype": "f32"}, narrow=True).source


def test_a_prologue_outside_the_narrow_phase_is_refused():
    with pytest.raises(TemplateError, match="narrow_phase"):
        render("gemv", "linear", *_tensors(72, 40, 40, "bf16"), attrs={"has_bias": False},
               prologue=PROLOGUE)


# the H200 table's narrow o_proj / down tile (4 rows x 1024 deep, 4 warps, no K split): K = 2300
# is 3 ragged chunks, all preloaded before the wait; 4500 is 5, two of them in the loop; N = 2562
# (641 row blocks: enough programs that K is not split, as in the model) leaves a half-filled last
# one. The fast suite runs N = 42 (11 row blocks, the last half-filled) with TARGET_CTAS lowered so
# that K is not split either (the same code path, 1/58 of the interpreted programs), and checks
# that the model's N alone chooses no split; the model's N runs with --exhaustive.
NARROW = {"BLOCK_N": 4, "FMA_BLOCK_K": 1024, "num_warps": 4}


def _splits_at_one_row(k) -> int:
    """The grid's K splits at T = 1 (the CUDA-core path's; the tensor-core path of a narrow step of
    several rows splits K on its own)."""
    z = k.meta["grid"][2]
    return z if isinstance(z, int) else eval(z, {"cdiv": lambda a, b: -(-a // b), "max": max, "min": min, "T": 1})


@pytest.mark.parametrize("N,K,tune", [pytest.param(n, k, t, id=f"{n}-{k}", marks=m) for k in (2300, 4500)
                                      for n, t, m in ((2562, NARROW, EXHAUSTIVE),
                                                      (42, {**NARROW, "TARGET_CTAS": 8}, ()))])
def test_the_narrow_plain_gemv_on_4_row_1024_deep_tiles(N, K, tune):
    gen = np.random.default_rng(N + K)
    x, w = rand((1, K), gen=gen), rand((N, K), gen=gen, scale=K ** -0.5)
    model = render("gemv", "linear", [("x", ["T", K], "bf16"), ("w", [2562, K], "bf16", "weight")],
                   [("y", ["T", 2562], "bf16")], attrs={"has_bias": False}, narrow=True, tune=NARROW)
    assert _splits_at_one_row(model) == 1
    k = render("gemv", "linear", [("x", ["T", K], "bf16"), ("w", [N, K], "bf16", "weight")],
               [("y", ["T", N], "bf16")], attrs={"has_bias": False}, narrow=True, tune=tune)
    assert k.meta["grid"][1] == (N + 3) // 4 and _splits_at_one_row(k) == 1
    y = poison((1, N))
    run(k, {"in:0": x, "in:1": w, "out:0": y}, {"T": 1, "B": 1})
    assert rel_err(f32(y), REGISTRY["linear"].reference(None, f32(x), f32(w))) <= TOL
