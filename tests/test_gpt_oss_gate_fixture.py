"""GPT-OSS's golden-gate fixture routes decisively (tests/gpu/gpu_families.py, issue 45): each
token's top-4 experts are its group's, by a margin far above bf16's error, in every layer; and
route_agreement.py (the GPU gate's check of that premise) counts disagreements right. At a small
width on the CPU; the real width is bench/NOTES.md's experiment (tools/experiments/moe_gate_cpu.py)."""
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
import gpu_families  # noqa: E402
import route_agreement  # noqa: E402

torch = pytest.importorskip("torch")
SMALL = dict(hidden_size=512, intermediate_size=64, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, head_dim=64, vocab_size=256, pad_token_id=None,
             layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=16)


def test_group_directions_are_orthonormal_and_fixed():
    a = gpu_families.group_directions(8, 96, "cpu")
    assert torch.allclose(a @ a.T, torch.eye(8), atol=1e-5)
    assert torch.equal(a, gpu_families.group_directions(8, 96, "cpu"))


def test_small_fixture_routes_each_token_to_its_group():
    from transformers import AutoModelForCausalLM
    cfg = gpu_families.hf_config("gpt-oss-20b-l4", **SMALL)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    gpu_families.redraw(model, 0, family="gpt_oss")
    E, K = cfg.num_local_experts, cfg.num_experts_per_tok
    groups = gpu_families.route_groups(E, K)
    ids = np.random.default_rng(0).integers(0, SMALL["vocab_size"], 40)
    # the router's own picks (its indices) and margins, as the GPU gate reads them
    picks, margins = route_agreement.routes(model, [ids.tolist()], "mlp.router", device="cpu")[0]
    want = np.sort((ids[:, None] % groups) + groups * np.arange(K)[None, :], -1)
    assert (picks == want[None]).all(), (picks != want[None]).any(-1).sum(-1)
    margin = margins.min(1)
    assert margin.min() > 1.0, margin          # nats: bf16 moves a router logit by ~0.01-0.05


def test_route_agreement_counts_flips_and_margins():
    from types import SimpleNamespace
    rng = np.random.default_rng(1)
    x = rng.normal(size=(2, 5, 8)).astype(np.float32)                  # [layers, T, E] router logits
    router = SimpleNamespace(top_k=2)                                   # a top-k router: no correction bias
    margins = np.stack([route_agreement.choice_margin(router, torch.from_numpy(lx)).numpy() for lx in x])
    srt = -np.sort(-x, -1)
    assert np.allclose(margins, srt[..., 1] - srt[..., 2])
    picks = np.sort(np.argsort(-x, -1)[..., :2], -1)
    other = picks.copy()
    other[1, 3] = np.sort(np.argsort(x[1, 3])[:2])                     # another top-2 at one (layer, position)
    frac, flips, margin = route_agreement.route_agreement([(picks, margins)], [(other, margins)])
    assert flips == 1 and frac == pytest.approx(9 / 10)
    assert np.allclose(margin, (srt[..., 1] - srt[..., 2]).min(1))
