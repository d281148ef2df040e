"""Qwen3-Next (specs/qwen3_next.yaml: Qwen3NextForCausalLM) against transformers' own model.

Two tiny random float32 checkpoints made by transformers and saved with save_pretrained (its default
writes each expert's gate_proj / up_proj / down_proj as its own tensor, the published layout): hidden
96, 4 q / 2 kv heads of 32 (partial RoPE on 8 dims), Gated DeltaNet with 2 key heads of 16 and 4
value heads of 24 (two value heads per key head, so in_proj_qkvz's and in_proj_ba's per-key-head
interleaving bites), 6 experts of 40, top 2, a shared expert of 56 behind its per-token sigmoid gate:
  mixed:  layer_types lin, full, lin, full; layer 2 in mlp_only_layers (a dense SwiGLU of 64),
          norm_topk_prob true
  sparse: config.json without layer_types (full_attention_interval 2 gives the kinds), the MoE
          every second layer (decoder_sparse_step 2: layers 0 and 2 dense), norm_topk_prob false
Every (1 + w) norm weight is random around 0, the gated norm's plain weight around 1, dt_bias random,
A_log = log(A) with A in [0.05, 1.5], the router and the shared expert's gate 3x HF's init (a decisive
top-2, a gate that varies from token to token).

The reference executor must give HF's (eager, float32) logits at every position of a 24-token prompt
within 1e-4 (as 24 prefixes in one step, and one token a step) and the same 16 greedy tokens as
generate(); the generated kernels under the interpreter, fused and --no-fuse, follow the reference
(tests/interp_protocol.py); each distinctive feature taken out of the spec moves the logits away from
HF's; the published variants agree with Qwen3NextConfig.
"""
import json

import numpy as np
import pytest
import torch

from infc.compiler.build import compile_model
from infc.compiler.contract import caches
from infc.compiler.contract.errors import SpecError
from infc.runtime.reference.executor import ReferenceExecutor, SeqChunk

from exhaustive import EXHAUSTIVE
from families import hf_greedy, hf_logits, plan_and_weights, reference_greedy, tiny_hf
from interp_protocol import bf16_tolerance, executors, sequences, through_kernels

VOCAB = 320
TOL = 1e-4
PROMPT = [int(t) for t in np.random.default_rng(17).integers(0, VOCAB, 24)]
E, K, FE, FS = 6, 2, 40, 56
BASE = dict(vocab_size=VOCAB, hidden_size=96, intermediate_size=64, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
            num_experts=E, num_experts_per_tok=K, moe_intermediate_size=FE,
            shared_expert_intermediate_size=FS, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=24, linear_conv_kernel_dim=4,
            max_position_embeddings=256, initializer_range=0.05, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
VARIANTS = {
    "mixed": dict(layer_types=["linear_attention", "full_attention"] * 2, mlp_only_layers=[2],
                  norm_topk_prob=True),
    "sparse": dict(full_attention_interval=2, decoder_sparse_step=2, norm_topk_prob=False),
}
# randomize()'s seed per variant: one whose router has no near-tie (2nd vs 3rd probability within
# 2e-3) on the kernels' prompts, which bf16 would flip (a different expert, not a kernel error)
SEEDS = {"mixed": 11, "sparse": 9}
SCHEDULES = {
    "mixed": ["linear_attention_moe", "full_attention_moe", "linear_attention_dense", "full_attention_moe"],
    "sparse": ["linear_attention_dense", "full_attention_moe", "linear_attention_dense", "full_attention_moe"],
}


def randomize(model, seed=5):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=gen)
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


def make(kind, d):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
    model = tiny_hf(Qwen3NextForCausalLM, Qwen3NextConfig, {**BASE, **VARIANTS[kind]},
                    d, 1234, randomize=lambda m: randomize(m, SEEDS[kind]))
    if kind == "sparse":                # the kinds from full_attention_interval, not layer_types
        c = json.loads((d / "config.json").read_text())
        c.pop("layer_types")
        c["full_attention_interval"] = 2
        (d / "config.json").write_text(json.dumps(c, indent=2))
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for kind in VARIANTS:
        d = tmp_path_factory.mktemp(f"qwen3_next-{kind}")
        out[kind] = (d, make(kind, d))
    return out


def assert_logits(plan, weights, want, prompt):
    """HF's logits at every position within TOL: as len(prompt) prefixes in one step, then one token
    a step (the recurrent state carried in its slot)."""
    got = ReferenceExecutor(plan, weights).step([SeqChunk(n, prompt[:n], 0) for n in range(1, len(prompt) + 1)])
    err = np.abs(got - want).max(axis=1)
    assert err.max() <= TOL, f"prefill: worst position {int(err.argmax())}, |diff| {err.max():.2e}"
    ex = ReferenceExecutor(plan, weights)
    err = [float(np.abs(ex.step([SeqChunk(0, [t], p)])[0] - want[p]).max()) for p, t in enumerate(prompt)]
    assert max(err) <= TOL, f"decode: worst position {int(np.argmax(err))}, |diff| {max(err):.2e}"


def broken_logits(d, spec_file, old, new, tmp_path, prompt=PROMPT) -> np.ndarray:
    """The reference's logits at every prefix of prompt under the built-in spec_file with every
    `old` replaced by `new` (the checkpoint check off: a broken spec may leave a tensor unread)."""
    from infc.compiler.contract.safetensors_io import Checkpoint
    from infc.compiler.spec import SPECS_DIR
    from infc.runtime.weights.load import load_weights
    text = (SPECS_DIR / spec_file).read_text()
    assert old in text, old
    path = tmp_path / spec_file
    path.write_text(text.replace(old, new))
    _, plan = compile_model(model_dir=str(d), spec_path=str(path), check_checkpoint=False)
    ex = ReferenceExecutor(plan, load_weights(plan, Checkpoint(d)))
    return ex.step([SeqChunk(n, prompt[:n], 0) for n in range(1, len(prompt) + 1)])


def assert_break_bites(d, hf, spec_file, old, new, tmp_path, floor=1e-3, prompt=PROMPT):
    """The spec with the feature taken out is far from HF (10x the tolerance or more)."""
    err = float(np.abs(broken_logits(d, spec_file, old, new, tmp_path, prompt) - hf_logits(hf, prompt)).max())
    assert err > floor, (old, new, err)


# -- the spec against transformers ----------------------------------------------------------------

def test_checkpoint_names_and_kinds(models):
    """The fused, per-key-head interleaved linear-attention projections and the per-expert names are
    what transformers saves; the plan's layer kinds are HF's token mixers x MLP kinds."""
    from safetensors import safe_open
    for kind, (d, hf) in models.items():
        with safe_open(d / "model.safetensors", "pt") as f:
            names = set(f.keys())
            assert f.get_slice("model.layers.0.linear_attn.in_proj_qkvz.weight").get_shape() == [2 * 16 * 2 + 2 * 4 * 24, 96]
            assert f.get_slice("model.layers.0.linear_attn.in_proj_ba.weight").get_shape() == [8, 96]
        assert f"model.layers.1.mlp.experts.{E - 1}.down_proj.weight" in names
        assert not any(n.endswith(("experts.gate_up_proj", "experts.down_proj")) for n in names)
        plan, _ = plan_and_weights(d)
        schedule = next(e for e in plan["programs"]["decode"] if "repeat" in e)["schedule"]
        hf_kinds = [f"{t}_{'moe' if type(l.mlp).__name__.endswith('SparseMoeBlock') else 'dense'}"
                    for t, l in zip(hf.config.layer_types, hf.model.layers)]
        assert schedule == hf_kinds == SCHEDULES[kind], kind
        decl = caches.of_plan(plan)            # the cache contract's reading of the plan
        assert decl["recurrent"]["layers"] == [0, 2]
        assert decl["k"]["layers"] == [1, 3]


@pytest.mark.parametrize("kind", list(VARIANTS))
def test_logits_and_greedy_match_hf(models, kind):
    d, hf = models[kind]
    want = hf_logits(hf, PROMPT)
    plan, weights = plan_and_weights(d)
    assert_logits(plan, weights, want, PROMPT)
    assert np.abs(want[1:] - want[:-1]).max() > 0.1          # no near-constant model
    greedy = hf_greedy(hf, PROMPT, 16, 0)
    assert reference_greedy(plan, weights, PROMPT, 16) == greedy


def test_fused_expert_layout_reads(models, tmp_path):
    """A save_original_format=False checkpoint (transformers 5's experts.gate_up_proj / down_proj)
    reads through the experts' `or:` layout and gives the same logits."""
    d, hf = models["mixed"]
    fused = tmp_path / "fused"
    hf.save_pretrained(fused, save_original_format=False)
    from safetensors import safe_open
    with safe_open(fused / "model.safetensors", "pt") as f:
        assert "model.layers.0.mlp.experts.gate_up_proj" in set(f.keys())
    plan, weights = plan_and_weights(fused)
    got = ReferenceExecutor(plan, weights).step([SeqChunk(0, PROMPT, 0)])
    assert np.abs(got[0] - hf_logits(hf, PROMPT)[-1]).max() <= TOL


BREAKS = {   # feature -> (variant, old spec text, the text that takes it out)
    # in_proj_qkvz read as Qwen3.5's contiguous q | k | v | z (not interleaved per key head)
    "qkvz_interleave": ("mixed", "rows: [2*Dk, 2*Dk + r*Dv], groups: Hk}", "rows: [2*Kd, 2*Kd + Vd]}"),
    "z_interleave": ("mixed", "rows: [2*Dk + r*Dv, G], groups: Hk}", "rows: [2*Kd + Vd, 2*Kd + 2*Vd]}"),
    # in_proj_ba read as b | a (not interleaved per key head)
    "ba_interleave": ("mixed", "rows: [r, 2*r], groups: Hk}", "rows: [Hv, 2*Hv]}"),
    "one_plus_w_norms": ("mixed", "shape: [H], offset: 1}", "shape: [H]}"),
    "renormalize": ("mixed", "moe_route(linear(h, router), K, norm_topk)",
                    "moe_route(linear(h, router), K, not norm_topk)"),
    "no_renormalize": ("sparse", "moe_route(linear(h, router), K, norm_topk)",
                       "moe_route(linear(h, router), K, not norm_topk)"),
    "shared_expert_gate": ("mixed", "shared = mul(shared, sigmoid(linear(h, ws_scale)))",
                           "shared = mul(shared, 1.0)"),
    "output_gate": ("sparse", "o = mul(view(a, [T, Hq*D]), sigmoid(linear(h, wgate)))", "o = view(a, [T, Hq*D])"),
    # the dense layers' MLP width: intermediate_size, not the experts'
    "dense_mlp": ("sparse", "x = add(x, linear(mul(silu(linear(h, wg)), linear(h, wu)), wd))",
                  "x = add(x, mul(linear(mul(silu(linear(h, wg)), linear(h, wu)), wd), 0.5))"),
}


FAST_BREAKS = ("qkvz_interleave", "ba_interleave", "renormalize", "shared_expert_gate")


@pytest.mark.parametrize("feature", [f if f in FAST_BREAKS else pytest.param(f, marks=EXHAUSTIVE) for f in BREAKS])
def test_feature_taken_out_moves_logits(models, feature, tmp_path):
    kind, old, new = BREAKS[feature]
    assert_break_bites(*models[kind], "qwen3_next.yaml", old, new, tmp_path)


def test_routing_features_bite_in_hf(models):
    """What the checks rest on: in a MoE layer the prompt's tokens reach every expert, the top-2's
    probabilities sum well below 1 (renormalizing shows), the shared expert's gate varies."""
    _, hf = models["mixed"]
    seen = {}
    hook = hf.model.layers[0].mlp.register_forward_hook(lambda m, a, o: seen.setdefault("h", a[0].reshape(-1, 96)))
    hf_logits(hf, PROMPT)
    hook.remove()
    mlp = hf.model.layers[0].mlp
    with torch.no_grad():
        top, idx = torch.softmax(seen["h"] @ mlp.gate.weight.T, -1).topk(K, dim=-1)
        gate = torch.sigmoid(seen["h"] @ mlp.shared_expert_gate.weight.T)[:, 0]
    assert set(idx.flatten().tolist()) == set(range(E))
    assert top.sum(-1).mean() < 0.85
    assert gate.max() - gate.min() > 0.3


def test_qwen3_5_moe_spec_cannot_read_it(models):
    """Not an alias: Qwen3.5's spec (separate in_proj_qkv / in_proj_z / in_proj_b / in_proj_a)
    fails on this checkpoint, naming a tensor it expected."""
    from infc.compiler.spec import SPECS_DIR
    with pytest.raises(SpecError, match=r"checkpoint tensor .* is missing"):
        compile_model(model_dir=str(models["mixed"][0]), spec_path=str(SPECS_DIR / "qwen3_5_moe.yaml"))


def test_mtp_tensors_are_ignored(models, tmp_path):
    """The published checkpoints carry the MTP head (mtp.*): the plan leaves it unread through the
    spec's `ignore:` entry (without it the build names the tensor)."""
    import shutil
    from safetensors.numpy import save_file
    from families import checkpoint_tensors
    from infc.compiler.spec import SPECS_DIR
    d = tmp_path / "with-mtp"
    shutil.copytree(models["mixed"][0], d)
    t = checkpoint_tensors(d)
    t["mtp.fc.weight"] = np.zeros((96, 192), np.float32)
    save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
    compile_model(model_dir=str(d))
    text = (SPECS_DIR / "qwen3_next.yaml").read_text()
    cut = text.replace('ignore:\n  - "mtp.*"\n', "")
    assert cut != text
    (tmp_path / "qwen3_next.yaml").write_text(cut)
    with pytest.raises(SpecError, match=r"mtp\.fc\.weight"):
        compile_model(model_dir=str(d), spec_path=str(tmp_path / "qwen3_next.yaml"))


# -- configs ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", ["qwen3-next-80b-a3b-instruct", "qwen3-next-80b-a3b-thinking"])
def test_published_variants_agree_with_hf(variant):
    """Each variant builds with no weights, and its layer kinds, widths and rotary dims are the ones
    Qwen3NextConfig derives from the same values."""
    from transformers import Qwen3NextConfig
    from infc.compiler.spec import SPECS_DIR, load_spec
    values = dict(load_spec(SPECS_DIR / "qwen3_next.yaml").variants[variant])
    _, plan = compile_model(variant)
    hf = Qwen3NextConfig(**{k: v for k, v in values.items() if k not in ("architectures", "model_type")})
    schedule = next(e for e in plan["programs"]["decode"] if "repeat" in e)["schedule"]
    moe = [i not in hf.mlp_only_layers and hf.num_experts > 0 and (i + 1) % hf.decoder_sparse_step == 0
           for i in range(hf.num_hidden_layers)]
    assert schedule == [f"{t}_{'moe' if m else 'dense'}" for t, m in zip(hf.layer_types, moe)]
    assert schedule == (["linear_attention_moe"] * 3 + ["full_attention_moe"]) * 12
    c = plan["config"]
    assert c["R"] == int(hf.head_dim * hf.rope_parameters["partial_rotary_factor"]) == 64
    assert c["theta"] == hf.rope_parameters["rope_theta"] == 10000000
    assert (c["E"], c["K"], c["Fe"], c["Fs"], c["norm_topk"], c["Hk"], c["Hv"], c["Dk"], c["Dv"]) == \
        (hf.num_experts, hf.num_experts_per_tok, hf.moe_intermediate_size, hf.shared_expert_intermediate_size,
         hf.norm_topk_prob, hf.linear_num_key_heads, hf.linear_num_value_heads, hf.linear_key_head_dim,
         hf.linear_value_head_dim)
    assert plan["weights"]["we_down"]["shape"] == [512, 2048, 512]


def test_config_defaults_are_hf(models, tmp_path):
    """A config.json with only the required keys binds to Qwen3NextConfig's defaults."""
    from transformers import Qwen3NextConfig
    c = json.loads((models["mixed"][0] / "config.json").read_text())
    cfg = {k: c[k] for k in ("architectures", "model_type", "vocab_size", "hidden_size",
                             "num_hidden_layers", "num_attention_heads")}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    _, plan = compile_model(model_dir=str(tmp_path), check_checkpoint=False)
    hf = Qwen3NextConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    got = plan["config"]
    assert (got["Hkv"], got["D"], got["F"], got["E"], got["K"], got["Fe"], got["Fs"], got["norm_topk"],
            got["sparse_step"], got["eps"], got["theta"], got["partial"], got["tie"], got["Hk"], got["Hv"],
            got["Dk"], got["Dv"], got["Kc"], got["max_len"]) == \
        (hf.num_key_value_heads, hf.head_dim, hf.intermediate_size, hf.num_experts, hf.num_experts_per_tok,
         hf.moe_intermediate_size, hf.shared_expert_intermediate_size, hf.norm_topk_prob,
         hf.decoder_sparse_step, hf.rms_norm_eps, hf.rope_parameters["rope_theta"],
         hf.rope_parameters["partial_rotary_factor"], hf.tie_word_embeddings, hf.linear_num_key_heads,
         hf.linear_num_value_heads, hf.linear_key_head_dim, hf.linear_value_head_dim,
         hf.linear_conv_kernel_dim, hf.max_position_embeddings)
    schedule = next(e for e in plan["programs"]["decode"] if "repeat" in e)["schedule"]
    assert schedule == [t + "_moe" for t in hf.layer_types]


def test_requires_refuse_attention_bias(models, tmp_path):
    c = json.loads((models["mixed"][0] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**c, "attention_bias": True}))
    with pytest.raises(SpecError, match="qkv_bias"):
        compile_model(model_dir=str(tmp_path), check_checkpoint=False)


# -- through the generated Triton kernels, interpreted -------------------------------------------

@pytest.mark.parametrize("kind,fuse", [("mixed", True),
                                       pytest.param("mixed", False, marks=EXHAUSTIVE),
                                       pytest.param("sparse", True, marks=EXHAUSTIVE),
                                       pytest.param("sparse", False, marks=EXHAUSTIVE)],
                         ids=["mixed-fused", "mixed-no-fuse", "sparse-fused", "sparse-no-fuse"])
def test_through_kernels(models, kind, fuse, tmp_path):
    d, hf = models[kind]
    plan, run, ref = executors(d, tmp_path / "art", fuse)
    a, b = sequences(VOCAB)
    through_kernels(plan, run, ref, a, b, bf16_tolerance(hf))
