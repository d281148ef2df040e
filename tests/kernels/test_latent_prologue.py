"""latent_prologue (compiler/ops/latent_prologue.py), the Triton template under the interpreter
against the op's reference (itself the composition of rope, rms_norm and concat's references):
random bf16 inputs read in place from wider rows (the fused projection's column slices), head
counts and latent widths that are not powers of two, interleaved and rotate-half ropes, YaRN,
partial rotary, bf16 and f32 norm weights, positions past 64k; rows past T stay unwritten."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from infc.compiler.ir import TensorType
from infc.compiler.ops import REGISTRY, ShapeError

from .harness import poison, rand, rel_err, render, run

TOL = 1e-2
YARN = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
        "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}

CASES = [
    # H, Dc, Dr, rotary_dim, interleaved, scaling, norm dtype, phase, positions
    (16, 512, 64, None, True, YARN, "bf16", "decode", [37]),                 # DeepSeek-V2-Lite's
    (3, 96, 32, None, True, None, "bf16", "prefill", [0, 1, 2, 70000, 5]),
    (5, 80, 48, 32, False, None, "f32", "prefill", [9, 4096, 17, 3]),         # 16 dims pass through
    (1, 40, 16, None, None, YARN, "bf16", "decode", [1, 2048, 131000]),
]


@pytest.mark.parametrize("h,dc,dr,rot,il,scaling,wdt,phase,positions", CASES)
def test_latent_prologue_kernel(h, dc, dr, rot, il, scaling, wdt, phase, positions):
    gen = np.random.default_rng(h * 1000 + dc + dr)
    T, d = len(positions), dc + dr
    # one fused projection row [q_nope-ish pad | q_pe | kv_a | pad], as the plan's split leaves it
    q_off, kv_off = 24, 24 + h * dr
    stride = kv_off + d + 8
    wide = rand((T + 2, stride), gen=gen, scale=2.0)
    q_pe = wide[:T, q_off: q_off + h * dr].reshape(T, h, dr)
    kv_a = wide[:T, kv_off: kv_off + d]
    q_lat = rand((T, h, dc), gen=gen)
    w = rand((dc,), dtype=wdt, gen=gen, scale=0.5)
    attrs = {"eps": 1e-6, "theta": 10000.0, "scaling": scaling, "rotary_dim": rot, "interleaved": il}
    k = render("latent_prologue", "latent_prologue",
               [("q_lat", ["T", h, dc], "bf16"), ("q_pe", ["T", h, dr], "bf16", "buffer", {"row_stride": stride}),
                ("kv_a", ["T", d], "bf16", "buffer", {"row_stride": stride}), ("kv_norm", [dc], wdt, "weight")],
               [("q", ["T", h, d], "bf16"), ("kv", ["T", d], "bf16")], attrs=attrs, phase=phase)
    q_full, kv_full = poison((T + 2, h, d)), poison((T + 2, d))
    flat = wide.view(-1)
    run(k, {"in:0": q_lat, "in:1": flat[q_off:], "in:2": flat[kv_off:], "in:3": w,
            "out:0": q_full[:T], "out:1": kv_full[:T],
            "meta:positions": torch.tensor(positions, dtype=torch.int32)}, {"T": T, "B": 1})
    assert torch.isnan(q_full[T:].float()).all() and torch.isnan(kv_full[T:].float()).all(), "wrote rows past T"
    ctx = SimpleNamespace(positions=np.asarray(positions, np.int64))
    want_q, want_kv = REGISTRY["latent_prologue"].reference(
        ctx, q_lat.float().numpy(), q_pe.float().numpy(), kv_a.float().numpy(), w.float().numpy(), **attrs)
    got_q, got_kv = q_full[:T].float().numpy(), kv_full[:T].float().numpy()
    assert np.array_equal(got_q[..., :dc], q_lat.float().numpy())          # the absorbed part is a copy
    assert rel_err(got_q, want_q) <= TOL and rel_err(got_kv, want_kv) <= TOL
    assert np.abs(got_kv - want_kv).max() <= 2 ** -6 * np.abs(want_kv).max()
    assert np.abs(got_q[..., dc:] - want_q[..., dc:]).max() <= 2 ** -7 * np.abs(want_q[..., dc:]).max()


def test_latent_prologue_shapes_are_checked():
    op = REGISTRY["latent_prologue"]
    attrs = {"eps": 1e-6, "theta": 1e4, "scaling": None, "rotary_dim": None, "interleaved": True}
    t = lambda *s: TensorType(s, "bf16")
    assert op.infer([t("T", 16, 512), t("T", 16, 64), t("T", 576), t(512)], attrs) == \
        [t("T", 16, 576), t("T", 576)]
    with pytest.raises(ShapeError, match="kv_a"):
        op.infer([t("T", 16, 512), t("T", 16, 64), t("T", 512), t(512)], attrs)
    with pytest.raises(ShapeError, match="kv_norm"):
        op.infer([t("T", 16, 512), t("T", 16, 64), t("T", 576), t(64)], attrs)
