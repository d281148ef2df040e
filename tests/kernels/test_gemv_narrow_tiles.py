"""A one-token narrow step's bf16 GEMV tiles where no tuning entry sets them (gemv.py.j2): a plain W
with more columns than rows (o_proj, down) on 4-row, 1024-deep tiles without a K split, a gated W
(gate|up) on 128-deep tiles; other launches keep the template's 32 x 256. Rendered, and run under
the interpreter against the ops' references at shapes ragged against those tiles (N not a multiple
of 4 rows, K not of 1024 columns)."""
import numpy as np

from infc.compiler.ops import REGISTRY

from .harness import poison, rand, rel_err, render, run
from .test_gemm_kernels import TOL, f32


def _plain(N, K, narrow=True, tune=None):
    return render("gemv", "linear", [("x", ["T", K], "bf16"), ("w", [N, K], "bf16", "weight")],
                  [("y", ["T", N], "bf16")], attrs={"has_bias": False}, narrow=narrow, tune=tune)


def _tiles(k):
    c = k.meta["constexprs"]
    return c["BLOCK_N"], c["FMA_BLOCK_K"], c["SPLIT"]


def test_the_tiles_each_launch_takes():
    assert _tiles(_plain(2000, 2100)) == (4, 1024, False)        # K > N: down / o_proj, 500 programs
    assert _tiles(_plain(42, 2100)) == (4, 1024, True)           # 11 programs: K split (AUTO_SPLIT)
    assert _tiles(_plain(300, 256))[:2] == (32, 256)              # K <= N: q|k|v keeps its tiles
    assert _tiles(_plain(42, 2100, narrow=False))[:2] == (32, 256)  # the decode program's launch
    assert _tiles(_plain(42, 2100, tune={"BLOCK_N": 16}))[:2] == (16, 1024)  # an entry wins
    # a verify program's launch: its rows on the tensor-core path (VERIFY_DOT), the one-row tile
    # the narrow one (at most VERIFY_TILE elements); its rows on the CUDA-core path: 32-row tiles
    assert _tiles(_plain(42, 2100, narrow=5))[:2] == (4, 1024)
    assert _tiles(_plain(42, 2100, narrow=5, tune={"FMA_T": "rows"}))[0] == 32
    gated = render("gemv_gated", "linear_gated", [("x", ["T", 96], "bf16"), ("w", [2 * 40, 96], "bf16", "weight")],
                   [("y", ["T", 40], "bf16")], attrs={"fn": "silu", "has_bias": False}, narrow=True)
    assert _tiles(gated)[:2] == (32, 128)


def test_four_row_tiles_against_the_reference():
    N, K = 42, 2100                 # 11 programs (the last holds 2 rows), K split in 3 (1024-deep tiles)
    gen = np.random.default_rng(7)
    x, w = rand((1, K), gen=gen), rand((N, K), gen=gen, scale=K ** -0.5)
    k = _plain(N, K)
    y = poison((1, N))
    run(k, {"in:0": x, "in:1": w, "out:0": y}, {"T": 1, "B": 1})
    assert rel_err(f32(y), REGISTRY["linear"].reference(None, f32(x), f32(w))) <= TOL


def test_gated_128_deep_tiles_against_the_reference():
    F, K = 40, 300
    gen = np.random.default_rng(8)
    x, w = rand((1, K), gen=gen), rand((2 * F, K), gen=gen, scale=K ** -0.5)
    k = render("gemv_gated", "linear_gated", [("x", ["T", K], "bf16"), ("w", [2 * F, K], "bf16", "weight")],
               [("y", ["T", F], "bf16")], attrs={"fn": "silu", "has_bias": False}, narrow=True)
    y = poison((1, F))
    run(k, {"in:0": x, "in:1": w, "out:0": y}, {"T": 1, "B": 1})
    want = REGISTRY["linear_gated"].reference(None, f32(x), f32(w), fn="silu", has_bias=False)
    assert rel_err(f32(y), want) <= TOL


def test_a_split_count_that_leaves_ranges_empty_is_trimmed():
    """K splits are whole FMA_BLOCK_K steps, ceil(steps / SPLIT_K) each: 38 steps of 256 (the fp8
    down's K 9728) in 9 splits are 8 ranges of 5 and an empty ninth, which the kernel no longer
    launches; the sums stay the reference's."""
    k = _plain(2560, 9728, tune={"BLOCK_N": 32, "FMA_BLOCK_K": 256, "SPLIT_K": 9})
    assert k.meta["constexprs"]["ZMAX"] == 8 and k.meta["grid"][2].startswith("1 + 7 * ")
    assert _plain(2560, 9728, tune={"BLOCK_N": 32, "FMA_BLOCK_K": 256, "SPLIT_K": 2}).meta["constexprs"]["ZMAX"] == 2
    N, K = 42, 300                  # 10 steps of 32 in 6 splits: 5 ranges of 2 (the sixth would be empty)
    gen = np.random.default_rng(9)
    x, w = rand((1, K), gen=gen), rand((N, K), gen=gen, scale=K ** -0.5)
    k = _plain(N, K, tune={"FMA_BLOCK_K": 32, "SPLIT_K": 6})
    assert k.meta["constexprs"]["ZMAX"] == 5
    y = poison((1, N))
    run(k, {"in:0": x, "in:1": w, "out:0": y}, {"T": 1, "B": 1})
    assert rel_err(f32(y), REGISTRY["linear"].reference(None, f32(x), f32(w))) <= TOL
