"""Qwen3.5 mixture of experts (specs/qwen3_5_moe.yaml) against transformers.

Two tiny random checkpoints made and saved by transformers itself (save_pretrained's default
writes each expert's gate_proj / up_proj / down_proj as its own tensor, the published Qwen3.5 MoE
layout): a Qwen3_5MoeForCausalLM directory (weights under model.; layers lin, full, lin, lin from
layer_types) and a Qwen3_5MoeForConditionalGeneration directory (text weights under
model.language_model., a vision tower the spec ignores, lm_head tied to the embedding by the
top-level tie_word_embeddings, config.json rewritten to give full_attention_interval 2 instead of
layer_types: lin, full, lin, full). Every layer is an MoE block: 6 experts of 40, top 2, always
renormalized, and a shared expert of 56 scaled per token by sigmoid(shared_expert_gate(h)); hidden
96 and the expert widths not multiples of 32. Every norm, dt_bias and A_log is random and non-zero
(as tests/test_qwen3_5.py), and the router and the shared expert's gate are drawn wide enough that
the routing is decisive and the gate varies from token to token.

The reference executor (float32) must give transformers' (float32) logits at every position of a
40-token prompt within 1e-4 (as 40 prefixes in one step, and one token per step), the same 16
greedy tokens as generate(), and two sequences batched the same logits as each alone; the
generated Triton kernels (TRITON_INTERPRET=1), fused and --no-fuse, must follow the reference as
tests/test_families_interp.py bounds the other families.
"""
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from infc.compiler.build import compile_model
from infc.compiler.contract import caches
from infc.compiler.contract.errors import SpecError
from infc.runtime.reference.executor import ReferenceExecutor, SeqChunk

from exhaustive import EXHAUSTIVE
from families import hf_logits, plan_and_weights, reference_greedy
from interp_protocol import bf16_tolerance, executors, sequences, through_kernels

VOCAB = 320
TOL = 1e-4
SPEC = Path(__file__).resolve().parent.parent / "specs" / "qwen3_5_moe.yaml"
PROMPT = [int(t) for t in np.random.default_rng(11).integers(0, VOCAB, 40)]
E, K, FE, FS = 6, 2, 40, 56
TEXT = dict(vocab_size=VOCAB, hidden_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, num_experts=E,
            num_experts_per_tok=K, moe_intermediate_size=FE, shared_expert_intermediate_size=FS,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=24, linear_conv_kernel_dim=4, max_position_embeddings=256,
            initializer_range=0.05,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                             "mrope_section": [1, 1, 2], "mrope_interleaved": True})


def _randomize(model):
    """(1 + w) norms: small random w; the gated norm's plain w: near 1; dt_bias random; A_log =
    log(A) with A in [0.05, 1.5] (decays that keep the state); the router and the shared expert's
    gate 3x HF's init (logits of std ~1.5: a decisive top-2, a gate from ~0.2 to ~0.8)."""
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=gen)
            if "visual" in name:
                continue
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.2 * r)
            elif "norm" in name:
                p.copy_(0.3 * r)
            elif name.endswith("dt_bias"):
                p.copy_(0.5 * r)
            elif name.endswith("A_log"):
                p.copy_(torch.log(0.05 + 1.45 * torch.rand(p.shape, generator=gen)))
            elif name.endswith(("mlp.gate.weight", "mlp.shared_expert_gate.weight")):
                p.copy_(0.15 * r)


def _causal():
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
    return Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(
        **TEXT, tie_word_embeddings=False,
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"]))


def _conditional():
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=96,
                  patch_size=4, temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)
    return Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(
        text_config={**TEXT, "full_attention_interval": 2, "tie_word_embeddings": True},
        vision_config=vision, tie_word_embeddings=True))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """kind ("causal" | "conditional") -> (directory, HF float32 model)."""
    out = {}
    for kind, make in (("causal", _causal), ("conditional", _conditional)):
        torch.manual_seed(1234)
        model = make().float().eval()
        model.set_attn_implementation("eager")
        _randomize(model)
        d = tmp_path_factory.mktemp(f"qwen3_5_moe-{kind}")
        model.save_pretrained(d)           # the default: the original (published) per-expert layout
        if kind == "conditional":          # the kinds from full_attention_interval, not layer_types
            cfg = json.loads((d / "config.json").read_text())
            cfg["text_config"].pop("layer_types")
            cfg["text_config"]["full_attention_interval"] = 2
            (d / "config.json").write_text(json.dumps(cfg, indent=2))
        out[kind] = (d, model)
    return out


def _layer_types(model):
    cfg = model.config
    return list(getattr(cfg, "text_config", cfg).layer_types)


# -- the spec against transformers --------------------------------------------------------------

def test_both_checkpoint_classes_bind(models):
    """Weights under model. or model.language_model. (the vision tower ignored), tying from the
    top-level flag, layer kinds from layer_types or full_attention_interval, each expert's
    tensors read from their own per-expert names."""
    from safetensors import safe_open
    for kind, (d, hf) in models.items():
        plan, weights = plan_and_weights(d)
        repeat = next(e for e in plan["programs"]["decode"] if "repeat" in e)
        assert repeat["schedule"] == _layer_types(hf), kind
        prefix = "model.language_model." if kind == "conditional" else "model."
        assert plan["weights"]["embed"]["source"] == {"tensor": prefix + "embed_tokens.weight"}
        assert ("tied" in plan["weights"]["lm_head"]["source"]) == (kind == "conditional")
        with safe_open(d / "model.safetensors", "pt") as f:
            names = set(f.keys())
        assert f"{prefix}layers.0.mlp.experts.{E - 1}.gate_proj.weight" in names
        assert not any(n.endswith(("experts.gate_up_proj", "experts.down_proj")) for n in names)
        # every layer (either kind) carries the routed experts and the shared expert
        assert plan["weights"]["we_down"]["layers"] == plan["weights"]["ws_down"]["layers"] == list(range(4))
        assert [np.shape(w) for w in weights["we_down"]] == [(E, 96, FE)] * 4
    assert _layer_types(models["conditional"][1]) == ["linear_attention", "full_attention"] * 2


def test_vision_tower_and_fused_experts(models, tmp_path):
    """The checkpoint check reads every tensor: the vision tower passes only through the spec's
    `ignore:` entry; a checkpoint saved with transformers 5's fused expert tensors
    (save_original_format=False: experts.gate_up_proj / experts.down_proj, not the published
    layout) builds through the experts' `or:` layout and reads them (its logits against HF:
    tests/test_fused_expert_layout.py)."""
    spec = SPEC.read_text()
    cut = spec.replace('  - "model.visual.*"\n', "")
    assert cut != spec
    (tmp_path / "qwen3_5_moe.yaml").write_text(cut)
    with pytest.raises(SpecError, match=r"model\.visual\."):
        compile_model(model_dir=str(models["conditional"][0]), spec_path=str(tmp_path / "qwen3_5_moe.yaml"))
    fused = tmp_path / "fused"
    models["causal"][1].save_pretrained(fused, save_original_format=False)
    _, plan = compile_model(model_dir=str(fused))
    assert "experts.gate_up_proj" in json.dumps(plan["weights"]) and "experts.{e}" not in json.dumps(plan["weights"])


def test_plan_declares_slot_caches(models):
    plan, _ = plan_and_weights(models["causal"][0])
    c = plan["caches"]
    assert c["conv"]["kind"] == c["recurrent"]["kind"] == "slot"
    assert c["conv"]["layers"] == c["recurrent"]["layers"] == [0, 2, 3]
    assert c["k"]["kind"] == "paged" and c["k"]["layers"] == [1]
    assert caches.storage_shape(c["recurrent"], 16, 1, 4) == (5, 4, 16, 24)
    assert "state_slots" in plan["step_metadata"]


@pytest.mark.parametrize("kind,fuse", [("causal", True), ("causal", False), ("conditional", True)],
                         ids=["causal", "causal-no-fuse", "conditional"])
def test_logits_at_every_position(models, kind, fuse):
    d, hf = models[kind]
    want = hf_logits(hf, PROMPT)
    plan, weights = plan_and_weights(d, fuse)
    # prefill: the prompt's 40 prefixes as 40 sequences of one step (40 state slots)
    got = ReferenceExecutor(plan, weights).step([SeqChunk(n, PROMPT[:n], 0) for n in range(1, 41)])
    err = np.abs(got - want).max(axis=1)
    assert err.max() <= TOL, f"prefill: worst position {int(err.argmax())}, |diff| {err.max():.2e}"
    # decode: one token per step, the state carried in its slot
    ex = ReferenceExecutor(plan, weights)
    err = [float(np.abs(ex.step([SeqChunk(0, [t], p)])[0] - want[p]).max()) for p, t in enumerate(PROMPT)]
    assert max(err) <= TOL, f"decode: worst position {int(np.argmax(err))}, |diff| {max(err):.2e}"
    # the features bite: this is no near-constant model
    assert np.abs(want[1:] - want[:-1]).max() > 0.1


def test_the_moe_features_bite(models):
    """On these weights the router spreads the prompt's tokens over every expert, the top-2's
    unnormalized weights sum well below 1 (a dropped renormalization would show), and the shared
    expert's sigmoid gate varies across tokens (a dropped or constant gate would show)."""
    _, hf = models["causal"]
    seen = {}
    hooks = [hf.model.layers[0].mlp.register_forward_hook(
        lambda m, args, out: seen.setdefault("h", args[0].reshape(-1, 96)))]
    hf_logits(hf, PROMPT)
    for h in hooks:
        h.remove()
    mlp = hf.model.layers[0].mlp
    with torch.no_grad():
        probs = torch.softmax(mlp.gate.weight @ seen["h"].T, dim=0).T            # [T, E]
        top, idx = probs.topk(K, dim=-1)
        gate = torch.sigmoid(seen["h"] @ mlp.shared_expert_gate.weight.T)[:, 0]
    assert set(idx.flatten().tolist()) == set(range(E))
    assert top.sum(-1).mean() < 0.85 and top.sum(-1).min() < 0.6
    assert gate.max() - gate.min() > 0.3


@pytest.mark.parametrize("kind", ["causal", "conditional"])
def test_greedy_16_tokens_match_hf(models, kind):
    d, hf = models[kind]
    with torch.no_grad():
        want = hf.generate(input_ids=torch.tensor([PROMPT]), max_new_tokens=16, min_new_tokens=16,
                           do_sample=False, pad_token_id=0)[0, len(PROMPT):].tolist()
    plan, weights = plan_and_weights(d)
    assert reference_greedy(plan, weights, PROMPT, 16) == want


def test_batched_sequences_equal_each_alone(models):
    """A 40-token and a 23-token prompt in one prefill step (their tokens routed together), then 3
    decode steps together: each row's logits are its own alone."""
    plan, weights = plan_and_weights(models["causal"][0])
    a, b = PROMPT, PROMPT[::-1][:23]
    steps = [[SeqChunk(0, a, 0), SeqChunk(1, b, 0)]]
    toks = [[5, 17, 250], [9, 9, 100]]
    for i in range(3):
        steps.append([SeqChunk(0, [toks[0][i]], len(a) + i), SeqChunk(1, [toks[1][i]], len(b) + i)])
    together = ReferenceExecutor(plan, weights)
    got = [together.step(s) for s in steps]
    for row in (0, 1):
        alone = ReferenceExecutor(plan, weights)
        for s, g in zip(steps, got):
            assert np.abs(alone.step([s[row]])[0] - g[row]).max() <= 1e-5


def test_published_variants_build():
    """Every variant builds with no weights; its layer kinds are the ones transformers derives from
    the same config.json (Qwen3_5MoeConfig's text_config.layer_types), and qwen3.5-35b-a3b's plan
    has 30 linear-attention and 10 full-attention layers, each with 256 experts of 512 read per
    expert and a shared expert of 512."""
    from transformers import AutoConfig
    from infc.compiler.spec import load_spec
    spec = load_spec(SPEC)
    assert set(spec.variants) == {"qwen3.5-35b-a3b", "qwen3.5-397b-a17b"}
    for name, values in spec.variants.items():
        _, plan = compile_model(name)
        values = {k: v for k, v in dict(values).items() if k != "model_type"}
        hf = AutoConfig.for_model("qwen3_5_moe", **values).text_config
        repeat = next(e for e in plan["programs"]["decode"] if "repeat" in e)
        assert repeat["schedule"] == list(hf.layer_types), name
        w = plan["weights"]
        assert w["we_down"]["shape"] == [hf.num_experts, hf.hidden_size, hf.moe_intermediate_size], name
        assert w["ws_down"]["shape"] == [hf.hidden_size, hf.shared_expert_intermediate_size], name
        assert w["lm_head"]["source"] == {"tensor": "lm_head.weight"}, name
    _, plan = compile_model("qwen3.5-35b-a3b")
    repeat = next(e for e in plan["programs"]["decode"] if "repeat" in e)
    assert repeat["schedule"] == (["linear_attention"] * 3 + ["full_attention"]) * 10
    w = plan["weights"]
    assert w["we_down"]["shape"] == [256, 2048, 512] and w["we_down"]["layers"] == list(range(40))
    assert w["we_down"]["source"]["stack"] == "model.language_model.layers.{i}.mlp.experts.{e}.down_proj.weight"
    slot = caches.select(plan["caches"], ["recurrent", "conv"], layers=[0])
    assert caches.storage_shape(slot["recurrent"], 16, 1, 2) == (3, 32, 128, 128)
    assert caches.unit_shape(plan["caches"]["k"]) == [2, 256]      # 2 KV heads of 256 a token


# -- through the generated Triton kernels, interpreted -------------------------------------------

@pytest.mark.parametrize("kind,fuse", [("causal", True), ("causal", False),
                                       pytest.param("conditional", True, marks=EXHAUSTIVE),
                                       pytest.param("conditional", False, marks=EXHAUSTIVE)],
                         ids=["causal-fused", "causal-no-fuse", "conditional-fused", "conditional-no-fuse"])
def test_through_kernels(models, kind, fuse, tmp_path):
    """As tests/test_families_interp.py: a 21-token prefill, a second sequence's prefix (16 tokens,
    computed: no shared state page) and its 6-token tail, then 2 batched decode steps, the second
    through the wide program (the experts on the grouped GEMMs); bf16 kernels against the float32
    reference within max(2e-2, twice HF's own bf16-vs-f32 error)."""
    d, hf = models[kind]
    plan, run, ref = executors(d, tmp_path / "art", fuse)
    a, b = sequences(VOCAB)

    def experts_on_their_kernels(run, step):
        # the experts: per-token kernels in the decode step, the grouped GEMMs in the wide one
        moe = {t for op, t in run.templates if op in ("moe_gate_up", "moe_down")}
        assert moe == ({"moe_gate_up_grouped", "moe_down_grouped"} if run.program == "wide"
                       else {"moe_gate_up", "moe_down"}), run.templates
    through_kernels(plan, run, ref, a, b, bf16_tolerance(hf),
                    check_step=experts_on_their_kernels)
