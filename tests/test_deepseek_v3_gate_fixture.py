"""DeepSeek-V3's golden-gate fixture routes decisively (tests/gpu/gpu_families.py, `_deepseek_v2_rule`):
the plan's high / low scores plus the correction bias's roles put both of the router's cuts (the
groups kept, the experts picked among them) between levels 0.3 apart, the bias changes the picks
(not the weights), and a small-width model built by redraw routes each token as its class's plan
says. route_agreement.choice_margin (the GPU gate's measure) is checked against a direct count.
The real width is bench/NOTES.md's experiment (tools/experiments/moe_gate_cpu.py)."""
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
import gpu_families  # noqa: E402
import route_agreement  # noqa: E402

torch = pytest.importorskip("torch")
NAME = "deepseek-v3-l5"
SMALL = dict(hidden_size=512, intermediate_size=256, moe_intermediate_size=32, num_hidden_layers=5,
             num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=32,
             qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, vocab_size=256, pad_token_id=None)


class Router(torch.nn.Module):
    """HF's DeepseekV3TopkRouter's choice, from given logits (the attributes choice_margin reads)."""

    def __init__(self, cfg, bias):
        super().__init__()
        self.top_k, self.num_group, self.topk_group = cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group
        self.e_score_correction_bias = bias

    def picks(self, logits, with_bias=True):
        s = logits.sigmoid() + (self.e_score_correction_bias if with_bias else 0)
        group = s.view(len(s), self.num_group, -1).topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(group).scatter_(1, group.topk(self.topk_group, dim=-1).indices, 1.0)
        s = s.masked_fill(keep.repeat_interleave(s.shape[1] // self.num_group, 1) == 0, float("-inf"))
        return s.topk(self.top_k, dim=-1).indices.sort(-1).values


@pytest.fixture(scope="module")
def cfg():
    return gpu_families.hf_config(NAME, **SMALL)


def plan_logits(cfg, logit=4.0):
    """[classes, E] the logits the plan aims at: +-logit by dsv3_signs."""
    return logit * gpu_families.dsv3_signs(cfg)


def test_plan_is_decisive_and_the_bias_decides(cfg):
    router = Router(cfg, gpu_families.dsv3_role_bias(cfg))
    logits = plan_logits(cfg)
    margin = route_agreement.choice_margin(router, logits)
    assert (margin > 0.29).all(), margin                      # both cuts between grid levels 0.3 apart
    biased, unbiased = router.picks(logits), router.picks(logits, with_bias=False)
    # classes 0, 1 and 3: the bias picks other experts than the scores alone (class 2 routes alike)
    differ = (biased != unbiased).any(-1).tolist()
    assert differ == [True, True, False, True], differ
    # the plan reaches most experts, and every class its own 8 in 4 groups
    assert len(set(biased.ravel().tolist())) >= 24
    assert all(len(set((row // 4).tolist())) == 4 for row in biased)


def test_choice_margin_counts_both_cuts(cfg):
    g = torch.Generator().manual_seed(3)
    router = Router(cfg, 0.1 * torch.randn(32, generator=g))
    logits = torch.randn(50, 32, generator=g)
    got = route_agreement.choice_margin(router, logits)
    s = (logits.sigmoid() + router.e_score_correction_bias).numpy()
    for t in range(50):
        group = np.sort(s[t].reshape(8, 4), -1)[:, -2:].sum(-1)
        order = np.sort(group)[::-1]
        kept = np.argsort(-group)[:4]
        among = np.sort(np.concatenate([s[t].reshape(8, 4)[j] for j in kept]))[::-1]
        want = min(order[3] - order[4], among[7] - among[8])
        assert got[t].item() == pytest.approx(want, abs=1e-6)


def test_small_fixture_routes_each_token_by_its_class_plan(cfg):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    gpu_families.redraw(model, 0, family="deepseek_v2")
    gates = [m for n, m in model.named_modules() if n.endswith("mlp.gate")]
    bias = gpu_families.dsv3_role_bias(cfg)
    for gate in gates:              # the drawn bias is the roles' plus a little noise
        assert (gate.e_score_correction_bias - bias).abs().max() < 0.06
        assert not torch.equal(gate.e_score_correction_bias, bias)
    ids = np.random.default_rng(0).integers(0, SMALL["vocab_size"], 40)
    got = route_agreement.routes(model, [ids.tolist()], "mlp.gate", device="cpu")[0]
    picks, margin = got
    want = Router(cfg, bias).picks(plan_logits(cfg))[ids % gpu_families.DSV3_CLASSES].numpy()
    assert picks.shape == (2, 40, 8)
    assert (picks == want[None]).all(), (picks != want[None]).any(-1).sum(-1)
    assert margin.min() > 0.15, margin.min(1)       # far above bf16's error on a saturated score
    frac, flips, _ = route_agreement.route_agreement([got], [got])
    assert (frac, flips) == (1.0, 0)


def test_deepseek_v2_lite_keeps_the_generic_draws():
    """The rule is keyed on the spec's family (deepseek_v2): V2-Lite's fixture must not change."""
    cfg = gpu_families.hf_config("deepseek-v2-lite-l8")
    assert not gpu_families._dsv3_decisive(cfg)
    p = torch.zeros(4, 8)
    assert not gpu_families._deepseek_v2_rule("model.layers.1.mlp.gate.weight", p, torch.Generator(), cfg)
