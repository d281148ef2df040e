"""tools/experiments/skinny_gemm_probe.py (issue 43): its kernel's three forms, interpreted, compute
out[t, n] = sum_k x[t, k] W[n, k] for the rows asked and leave the padded rows alone, whole and
split over K (a ragged last range), so what the GPU call times is the GEMM it names."""
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools" / "experiments"))
import skinny_gemm_probe  # noqa: E402


@pytest.mark.parametrize("form", ["ptr", "tma", "norm"])
@pytest.mark.parametrize("split", [1, 3])
def test_the_probe_kernels_equal_numpy(form, split):
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8))
    skinny = skinny_gemm_probe.kernels()
    rng = np.random.default_rng(split)
    n, k, rows, bk = 128, 320, 5, 64
    # fp16: the interpreter's bf16 loads are not the GPU's (the probe runs bf16 there)
    w = torch.from_numpy(rng.standard_normal((n, k)).astype(np.float16))
    x = torch.from_numpy(rng.standard_normal((16, k)).astype(np.float16))
    out = torch.zeros(16, n)
    k_per = -(-k // split // bk) * bk
    g = rng.standard_normal(k).astype(np.float16)
    inv = rng.uniform(0.5, 2.0, 16).astype(np.float32)
    skinny[(n // 64, split)](w, x, out, n, k, rows, k_per, torch.from_numpy(g), torch.from_numpy(inv), FORM=form,
                             BN=64, BK=bk, BT=16, STAGES=3, ATOMIC=split > 1)
    if form == "norm":
        a = (x.float().numpy() * g.astype(np.float32)[None, :] * inv[:, None]).astype(np.float16)
    else:
        a = x.numpy()
    ref = a[:rows].astype(np.float64) @ w.double().numpy().T
    np.testing.assert_allclose(out[:rows].numpy(), ref, rtol=1e-3, atol=1e-3)
    assert not out[rows:].any()
