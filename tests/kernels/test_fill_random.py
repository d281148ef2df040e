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
