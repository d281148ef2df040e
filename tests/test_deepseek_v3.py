"""DeepSeek-V3 / Kimi-K2 (DeepseekV3ForCausalLM, bound by specs/deepseek_v2.yaml) against
transformers' own model: tiny random float32 checkpoints made by transformers and saved with
save_pretrained, YaRN rope, q_lora, the first layer dense, and the V3 router (sigmoid scores, a
random e_score_correction_bias that changes choices, 4 groups with the best 2 kept, norm_topk_prob,
routed_scaling_factor 2.5); Kimi-K2's form (model_type kimi_k2, one group). The reference executor
must give HF's (eager, float32) logits at every position of a 24-token prompt within 1e-4, as 24
prefixes in one step and one token per step, and the same 16 greedy tokens as generate(); the V3
checkpoint through its generated kernels under the interpreter (tests/test_deepseek_v2_interp.py's
check: prefill, a narrow and a wide decode step)."""
import json

import numpy as np
import pytest
import torch

from infc.compiler.build import compile_model
from infc.compiler.contract.errors import SpecError
from infc.compiler.contract.safetensors_io import Checkpoint
from infc.runtime.reference.executor import ReferenceExecutor, SeqChunk
from infc.runtime.weights.load import load_weights

from families import hf_greedy, reference_greedy
from test_deepseek_v2 import BASE, PROMPT, TOL, VOCAB, _randomize, assert_logits, make_all

VARIANTS = {
    "v3": dict(q_lora_rank=24, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5),
    "kimi": dict(q_lora_rank=24, n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.827),
}


def randomize_v3(model, layers):
    """Random non-trivial norms (test_deepseek_v2's) and, in each MoE layer of `layers`, a
    correction bias large enough to move the choices (HF initializes it to zero)."""
    _randomize(model)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for layer in layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                gate.e_score_correction_bias.copy_(0.5 * torch.randn(gate.e_score_correction_bias.shape, generator=gen))


def make(kind: str, d):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    torch.manual_seed(4322)
    cfg = DeepseekV3Config(**{**BASE, **VARIANTS[kind]})
    model = DeepseekV3ForCausalLM(cfg).float().eval()
    model.set_attn_implementation("eager")
    randomize_v3(model, model.model.layers)
    model.save_pretrained(d)
    if kind == "kimi":             # Kimi-K2's config.json names its own model_type
        c = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**c, "model_type": "kimi_k2"}))
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_all(tmp_path_factory, "deepseek_v3", VARIANTS, make)


def _plan(d):
    _, plan = compile_model(model_dir=str(d))
    return plan, load_weights(plan, Checkpoint(d))


@pytest.mark.parametrize("kind", list(VARIANTS))
def test_logits_and_greedy_match_hf(models, kind):
    d, hf = models[kind]
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([PROMPT])).logits[0].float().numpy()
    plan, weights = _plan(d)
    routes = [n for n in json.dumps(plan["programs"]["prefill"]).split('"op": ') if n.startswith('"moe_route')]
    assert routes and all('"scoring": "sigmoid"' in n and '"has_bias": true' in n for n in routes)
    assert_logits(plan, weights, want, PROMPT)
    greedy = hf_greedy(hf, PROMPT, 16, VOCAB - 1)
    assert reference_greedy(plan, weights, PROMPT, 16) == greedy


def test_bias_matters(models):
    """Without the correction bias the model's logits move: the bias is read, and it chooses."""
    d, hf = models["v3"]
    plan, weights = _plan(d)
    got = ReferenceExecutor(plan, weights).step([SeqChunk(0, PROMPT, 0)])
    for name in [k for k in weights if k.startswith("router_bias")]:
        weights[name] = [np.zeros_like(w) for w in weights[name]] if isinstance(weights[name], list) else np.zeros_like(weights[name])
    zero = ReferenceExecutor(plan, weights).step([SeqChunk(0, PROMPT, 0)])
    assert np.abs(got - zero).max() > 1e-3


def test_rope_interleave_false_refused(tmp_path, models):
    d, _ = models["v3"]
    c = json.loads((d / "config.json").read_text())
    bad = tmp_path / "m"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**c, "rope_interleave": False}))
    with pytest.raises(SpecError, match="rope_il"):
        compile_model(model_dir=str(bad))


def test_through_kernels(models, tmp_path):
    from test_deepseek_v2_interp import check_through_kernels
    check_through_kernels(*models["v3"], tmp_path)


def test_fp8_checkpoint_dequantizes_the_heads_weights(models, tmp_path):
    """DeepSeek-V3 as published in FP8 (128 x 128 blocks; 8 x 8 here): the linears and experts
    read e4m3 codes, and kv_b_proj, which the spec cuts per head into W_uk / W_uv, is dequantized
    at load by the definition (codes x weight_scale_inv per block), then cut: each head's matrices
    equal the definition's rows exactly; q_b_proj, whose rows the spec regroups, stays quantized
    with a scale a row; the whole model equals HF's model of the definition to 1e-4."""
    import sys
    from pathlib import Path
    from safetensors.torch import load_file
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    from quantize_model import quantize_model
    d, hf = models["v3"]
    quantize_model(d, tmp_path, "fp8-block", block=(8, 8))
    plan, weights = _plan(tmp_path)
    assert plan["weights"]["w_uk"]["dtype"] == "bf16" and "quant" not in plan["weights"]["w_uk"]
    assert any(w.get("dtype") == "f8e4m3" for w in plan["weights"].values())
    t = {}
    for f in sorted(tmp_path.glob("*.safetensors")):
        t.update(load_file(str(f)))
    for i in range(3):
        m = f"model.layers.{i}.self_attn.kv_b_proj"
        assert t[m + ".weight"].dtype == torch.float8_e4m3fn
        codes = t[m + ".weight"].float().numpy()
        scale = np.repeat(np.repeat(t[m + ".weight_scale_inv"].float().numpy(), 8, 0), 8, 1)[:codes.shape[0], :codes.shape[1]]
        wb = (codes * scale).reshape(4, 16 + 12, 32)
        np.testing.assert_allclose(weights["w_uk"][i], wb[:, :16].transpose(0, 2, 1), rtol=0, atol=0)
        np.testing.assert_allclose(weights["w_uv"][i], wb[:, 16:], rtol=0, atol=0)
    # q_b_proj, cut into its nope and rope rows per head (then fused back as q|pe), reads its
    # codes with one scale a row (the block's), and quantizes its input as the format does
    assert plan["weights"]["wq_nope_pe"]["dtype"] == "f8e4m3"
    assert plan["weights"]["wq_nope_pe_w_scale"]["shape"][0] == plan["weights"]["wq_nope_pe"]["shape"][0]
    # the whole model against HF's model of the same checkpoint by the format's definition
    # (tests/gpu/hf_quant.py: dequantized weights, activations quantized per group), float32,
    # except kv_b_proj's input: the absorbed form never applies kv_b_proj to the latent (W_uk
    # multiplies the query, W_uv the attention output), so it reads kv_b_proj dequantized, as
    # vLLM's MLA does, with no activation of it to quantize
    sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
    import hf_quant
    q = hf_quant.load(tmp_path, torch.float32).eval()
    for name, module in q.named_modules():
        if name.endswith("kv_b_proj"):
            module._forward_pre_hooks.clear()
    with torch.no_grad():
        want = q(input_ids=torch.tensor([PROMPT])).logits[0].float().numpy()
    assert_logits(plan, weights, want, PROMPT)


@pytest.mark.parametrize("kind,par,fp8", [
    ("v3", dict(tensor_parallel_size=2, enable_expert_parallel=True), False),
    ("kimi", dict(expert_parallel_only=2), False),
    ("v3", dict(tensor_parallel_size=2, enable_expert_parallel=True), True),    # FP8 as published
    ("v3", dict(data_parallel_size=2, enable_expert_parallel=True), True),
], ids=["v3-tp2-ep", "kimi-ep2", "v3-fp8-tp2-ep", "v3-fp8-dp2-ep"])
def test_simulated_ranks_equal_the_single_rank_plan(models, tmp_path, kind, par, fp8):
    """The parallel layouts of the 8-GPU runs at tiny widths: each rank's plan (TP heads, EP
    experts, DP attention; FP8 codes and scales sliced per rank) on simulated ranks gives the
    single-rank plan's logits, every position of a prompt and then one token a step."""
    from infc.compiler.build import compile_ranks
    from infc.compiler.parallel import settings
    from infc.runtime.reference.ranks import RankExecutor
    d, _ = models[kind]
    if fp8:
        import sys
        from pathlib import Path
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
        from quantize_model import quantize_model
        quantize_model(d, tmp_path, "fp8-block", block=(8, 8))
        d = tmp_path
    one = ReferenceExecutor(*_plan(d))
    plans = [p for _, p in compile_ranks(settings(**par), model_dir=str(d))]
    many = RankExecutor(plans, [load_weights(p, Checkpoint(d)) for p in plans])
    ids = PROMPT[:12]
    if "data_parallel_size" in par:        # each rank its own sequences, its own step
        per = [[SeqChunk(10 * r + k, ids[:k + r], 0) for k in range(1, 6)] for r in range(len(plans))]
        for r, got in enumerate(many.step_ranks(per)):
            assert np.abs(got - one.step(per[r])).max() <= TOL, r
        return
    chunks = [SeqChunk(k, ids[:k], 0) for k in range(1, len(ids) + 1)]
    assert np.abs(many.step(chunks) - one.step(chunks)).max() <= TOL
    for pos, t in enumerate(ids):
        step = [SeqChunk(100, [t], pos)]
        assert np.abs(many.step(step) - one.step(step)).max() <= TOL, pos
