"""fill_random (--load-format dummy) under the interpreter: equal to its numpy mirror
(runtime/weights/dummy.py values), deterministic, finite, mean/std as promised, a different seed
gives different values, odd sizes are written exactly up to N."""
import numpy as np
import pytest
import torch

from infc.runtime.weights.dummy import seed_of, values
from infc.compiler.contract.safetensors_io import f32_to_bf16_bits

from .harness import poison, render, run


def fill(n, seed, scale=0.02, offset=0.0, dtype="bf16", size=None):
    k = render("fill_random", "fill_random", [], [], config={"dtype": dtype})
    out = poison((size or n,), dtype)
    run(k, {"out:0": out, "arg:seed": seed, "arg:scale": scale, "arg:offset": offset}, {"N": n})
    return out


def as_f32(t):
    return t.float().numpy()


@pytest.mark.parametrize("dtype,scale,offset", [("bf16", 0.02, 1.0), ("bf16", 0.02, 0.0), ("f32", 0.02, 1.0),
                                                 ("f32", 0.37, -0.6)])
def test_equals_the_numpy_mirror(dtype, scale, offset):
    n, seed = 1 << 14, seed_of("wq", 3)
    got = fill(n, seed, scale, offset, dtype)
    assert got.dtype == {"bf16": torch.bfloat16, "f32": torch.float32}[dtype]
    want = values(n, seed, scale, offset)
    if dtype == "bf16":     # the CPU backend loads these bits: rounded once, to nearest even
        assert np.array_equal(got.view(torch.int16).numpy().view(np.uint16), f32_to_bf16_bits(want))
    else:
        assert np.array_equal(as_f32(got), want)


def test_deterministic_finite_and_normal():
    n = 1 << 16
    a, b = fill(n, 12345), fill(n, 12345)
    assert torch.equal(a, b)
    x = as_f32(a).astype(np.float64)
    assert np.isfinite(x).all()
    assert abs(x.mean()) < 0.02 * 0.02                 # 0.02 std, 65536 draws: mean ~ 8e-5 +- ...
    assert abs(x.std() / 0.02 - 1) < 0.02
    assert np.abs(x).max() <= 0.02 * 3.47
    assert len(np.unique(x)) > 200                     # not a few repeated levels
    y = as_f32(fill(n, 12345, 0.02, 1.0)).astype(np.float64)   # a norm scale: 1 + noise
    assert abs(y.mean() - 1) < 1e-3 and 0.015 < y.std() < 0.025


def test_different_seeds_differ():
    n = 4096
    a = as_f32(fill(n, seed_of("wq", 0)))
    b = as_f32(fill(n, seed_of("wk", 0)))
    c = as_f32(fill(n, seed_of("wq", 1)))
    for x, y in ((a, b), (a, c), (b, c)):
        assert (x != y).mean() > 0.9
        assert abs(np.corrcoef(x, y)[0, 1]) < 0.1
        assert abs(np.corrcoef(np.sort(x), np.sort(y))[0, 1]) > 0.99   # same distribution
    assert not np.array_equal(np.sort(a), np.sort(values(n, seed_of("wq", 0) ^ 1, 0.02, 0.0)))


@pytest.mark.parametrize("n", [1, 7, 1023, 1025, 2500])
def test_odd_sizes_stop_at_n(n):
    out = fill(n, 7, size=n + 40)
    x = as_f32(out)
    assert np.isfinite(x[:n]).all()
    assert np.isnan(x[n:]).all()                       # nothing past N is written


# ---- the quantized weights' fill kinds (compiler/contract/weight_roles.py FILL_KINDS) ----
def fill_kind(kind, n, named, torch_dtype, size=None):
    """Run the rendered fill kernel of `kind` on n elements of a sentinel-filled buffer."""
    from infc.compiler.codegen.render import _render_fill
    k = _render_fill(kind)
    out = torch.full(((size or n),), 0x55, dtype=torch.uint8).view(torch_dtype) if torch_dtype.itemsize == 1 \
        else torch.full((size or n,), -7777, dtype=torch.int32).view(torch_dtype)
    run(k, {"out:0": out, **{f"arg:{a}": v for a, v in named.items()}}, {"N": n})
    return out


def test_e4m3_codes_equal_the_mirror_and_are_never_nan():
    """The e4m3 fill's bytes equal the numpy mirror's (runtime/weights/dummy.py); 0x7f / 0xff
    (NaN) never appear, every other code does."""
    from infc.runtime.weights.dummy import fill_values
    n = 3000
    w = {"shape": [30, 100], "dtype": "f8e4m3", "source": {"fp8": "w"}}
    seed = seed_of("wqkv", 2)
    got = fill_kind("f8e4m3", n, {"seed": seed}, torch.uint8, n + 40).numpy()
    assert np.array_equal(got[:n], fill_values("wqkv", w, 2)) and (got[n:] == 0x55).all()
    assert not ((got[:n] & 0x7F) == 0x7F).any() and len(np.unique(got[:n])) == 254


def test_bytes_index_and_round_kinds():
    from infc.runtime.weights.dummy import _mix
    n, seed = 2500, seed_of("w_u4", 0)
    got = fill_kind("bytes", n, {"seed": seed}, torch.uint8, n + 8).numpy()
    want = (_mix(_mix(np.arange(n, dtype=np.uint32)) ^ np.uint32(seed)) >> np.uint32(24)).astype(np.uint8)
    assert np.array_equal(got[:n], want) and (got[n:] == 0x55).all()
    assert len(np.unique(got[:n])) == 256 and abs(float(got[:n].mean()) - 127.5) < 8
    # w_gidx of two 100-column rows, groups of 32 columns: k // 32 in each row
    g = fill_kind("index", 200, {"period": 100, "div": 32}, torch.int32, 210).numpy()
    assert np.array_equal(g[:200], np.tile(np.arange(100) // 32, 2)) and (g[200:] == -7777).all()
    z = fill_kind("round", 1000, {"seed": 9, "scale": 2.0, "offset": 8.5}, torch.float32).numpy()
    assert np.array_equal(z, np.floor(values(1000, 9, 2.0, 8.5)))
    assert z.min() >= 1 and z.max() <= 15 and len(np.unique(z)) > 8
