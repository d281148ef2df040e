"""DeepSeek-V4's golden-gate fixture routes decisively (tests/gpu/gpu_families.py, `_deepseek_v4_rule`):
the plan's high / low logits put the scored router's K-th pick far above the (K + 1)-th, the
correction bias takes each class's drop expert out (the picks differ without it), and a small model
built by redraw routes each token as its class's plan says, its hash layers by the table.
route_agreement.choice_margin is checked against a direct count for V4's routers. The real width
is bench/NOTES.md's experiment (tools/experiments/moe_gate_cpu.py --family deepseek-v4-flash-l3)."""
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
import gpu_families  # noqa: E402
import route_agreement  # noqa: E402

torch = pytest.importorskip("torch")
NAME = gpu_families.DSV4_CUT
SMALL = dict(vocab_size=256, hidden_size=512, num_attention_heads=4, head_dim=32, q_lora_rank=32,
             partial_rotary_factor=8 / 32, o_groups=2, o_lora_rank=16, index_n_heads=4, index_head_dim=16,
             index_topk=8, sliding_window=16, moe_intermediate_size=32, n_routed_experts=8,
             num_experts_per_tok=2, hc_mult=2, max_position_embeddings=512, pad_token_id=None)


def sqrtsoftplus(x):
    return torch.nn.functional.softplus(x).sqrt()


class Router(torch.nn.Module):
    """HF's DeepseekV4TopKRouter's choice, from given logits (the attributes choice_margin reads)."""

    def __init__(self, k, bias):
        super().__init__()
        self.top_k, self.e_score_correction_bias, self.score_fn = k, bias, sqrtsoftplus

    def picks(self, logits, with_bias=True):
        s = sqrtsoftplus(logits) + (self.e_score_correction_bias if with_bias else 0)
        return s.topk(self.top_k, dim=-1).indices.sort(-1).values


@pytest.fixture(scope="module", params=["cut", "small"])
def cfg(request):
    return gpu_families.hf_config(NAME, **({} if request.param == "cut" else SMALL))


def plan_logits(cfg, logit=gpu_families.DSV4_LOGIT):
    return logit * gpu_families.dsv4_signs(cfg)


def test_plan_is_decisive_and_the_bias_decides(cfg):
    E, K, C = cfg.n_routed_experts, cfg.num_experts_per_tok, gpu_families.DSV4_CLASSES
    router = Router(K, gpu_families.dsv4_role_bias(cfg))
    logits = plan_logits(cfg)
    assert (route_agreement.choice_margin(router, logits) > 0.9).all()
    # a third of the plan's logit still leaves the pick a clear margin
    assert (route_agreement.choice_margin(router, logits / 3) > 0.3).all()
    biased = router.picks(logits)
    assert all(c not in biased[c].tolist() for c in range(C))             # the bias drops it
    # unbiased, the class's K + 1 high experts tie: a router that ignores the bias picks by chance
    assert (route_agreement.choice_margin(Router(K, torch.zeros(E)), logits) == 0).all()
    # every normal expert is some class's pick; no drop expert is anyone's
    assert sorted(set(biased.ravel().tolist())) == list(range(C, E))


def test_choice_margin_of_v4_routers():
    g = torch.Generator().manual_seed(3)
    router = Router(6, 0.1 * torch.randn(16, generator=g))
    logits = torch.randn(40, 16, generator=g)
    got = route_agreement.choice_margin(router, logits)
    s = np.sort((sqrtsoftplus(logits) + router.e_score_correction_bias).numpy(), -1)[:, ::-1]
    np.testing.assert_allclose(got.numpy(), s[:, 5] - s[:, 6], atol=1e-6)
    hashed = torch.nn.Module()
    hashed.top_k, hashed.tid2eid = 6, torch.zeros(4, 6)
    assert torch.isinf(route_agreement.choice_margin(hashed, logits)).all()


def test_small_fixture_routes_each_token_by_its_class_plan():
    from transformers import AutoModelForCausalLM
    cfg = gpu_families.hf_config(NAME, **SMALL)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    gpu_families.redraw(model, 0, family="deepseek_v4")
    gates = {n: m for n, m in model.named_modules() if n.endswith("mlp.gate")}
    scored = [m for m in gates.values() if not hasattr(m, "tid2eid")]
    assert len(scored) == 1
    bias = gpu_families.dsv4_role_bias(cfg)
    assert (scored[0].e_score_correction_bias - bias).abs().max() < 0.03
    assert not torch.equal(scored[0].e_score_correction_bias, bias)
    ids = np.random.default_rng(0).integers(0, SMALL["vocab_size"], 40)
    got = route_agreement.routes(model, [ids.tolist()], "mlp.gate", device="cpu")[0]
    picks, margin = got
    assert picks.shape == (3, 40, 2)
    for layer, gate in enumerate(gates.values()):
        if hasattr(gate, "tid2eid"):             # hash layers: the table's picks, margin infinite
            assert (picks[layer] == gate.tid2eid[ids].sort(-1).values.numpy()).all()
            assert np.isinf(margin[layer]).all()
        else:
            want = Router(2, bias).picks(plan_logits(cfg))[ids % gpu_families.DSV4_CLASSES].numpy()
            assert (picks[layer] == want).all(), (picks[layer] != want).any(-1).sum()
            assert margin[layer].min() > 0.3, margin[layer].min()


def test_other_models_keep_the_generic_draws():
    """The rule keys on the spec's family and the plan's shape: a V4 config with too few experts
    for the classes draws its router as before."""
    cfg = gpu_families.hf_config(NAME, **dict(SMALL, n_routed_experts=4))
    assert not gpu_families._dsv4_decisive(cfg)
    p = torch.zeros(4, 512)
    assert not gpu_families._deepseek_v4_rule("model.layers.2.mlp.gate.weight", p, torch.Generator(), cfg)
    assert (p == 0).all()
