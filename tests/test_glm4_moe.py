"""GLM-4.5 / GLM-4.5-Air / GLM-4.6 / GLM-4.7 (specs/glm4_moe.yaml: Glm4MoeForCausalLM) against
transformers' own model: tiny random float32 checkpoints made by transformers and saved with
save_pretrained (its default save_original_format=True, which writes the published per-expert
layout: mlp.experts.{e}.gate_proj.weight etc., not transformers 5's fused gate_up_proj), hidden
96, 4 query heads over 2 KV heads of head_dim 32 (not hidden / heads), partial rotary 0.5 (16
rotary dims at the start of each head, rotate-half), q/k/v biases, the first layer dense and two
MoE layers of 8 routed experts:
  glm45: GLM-4.5's form: q/k RMSNorm, 4 groups of which the best 2 are kept (the group limit
         bites), top-2, norm_topk_prob, routed_scaling_factor 2.5, one shared expert
  air:   GLM-4.5-Air's form: no q/k norm, one group, top-3, norm_topk_prob false,
         routed_scaling_factor 1.5, two shared experts
Every RMSNorm, every attention bias and a correction bias large enough to move the choices are
random (HF initializes them to 1, 0 and 0).

The reference executor must give HF's (eager, float32) logits at every position of a 24-token
prompt within 1e-4, as 24 prefixes in one step and one token per step, and the same 16 greedy
tokens as generate(); the generated kernels under the interpreter (TRITON_INTERPRET=1), fused and
--no-fuse, match the reference (a prefill, a prefix-cached prefill over a shared page, batched
decode steps through the decode and wide programs, and the narrow program); a checkpoint carrying
its MTP layer as published (model.layers.{L}.*) builds and gives the same logits, and the `mtp:`
section's drafts equal a reference written from HF's modules.
"""
import copy
import json

import numpy as np
import pytest
import torch

from infc.compiler.build import compile_model
from infc.runtime.reference.executor import ReferenceExecutor, SeqChunk

from exhaustive import EXHAUSTIVE
from families import (checkpoint_tensors, hf_greedy, hf_logits, plan_and_weights, reference_greedy,
                      tiny_hf)
from test_deepseek_v2 import PROMPT, VOCAB, assert_logits, make_all

BASE = dict(vocab_size=VOCAB, hidden_size=96, intermediate_size=128, moe_intermediate_size=32,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            n_routed_experts=8, first_k_dense_replace=1, attention_bias=True,
            partial_rotary_factor=0.5, rope_theta=10000.0, rms_norm_eps=1e-5,
            max_position_embeddings=512, initializer_range=0.08, tie_word_embeddings=False)
VARIANTS = {
    "glm45": dict(use_qk_norm=True, n_group=4, topk_group=2, num_experts_per_tok=2,
                  norm_topk_prob=True, routed_scaling_factor=2.5, n_shared_experts=1),
    "air": dict(use_qk_norm=False, n_group=1, topk_group=1, num_experts_per_tok=3,
                norm_topk_prob=False, routed_scaling_factor=1.5, n_shared_experts=2),
}


def randomize(model, seed=7):
    """Every norm weight 1 + 0.3 N(0, 1), every bias (q/k/v) 0.1 N(0, 1), every router's
    correction bias 0.5 N(0, 1): large against the sigmoid scores' spread, so it moves choices."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                gate.e_score_correction_bias.copy_(0.5 * torch.randn(gate.e_score_correction_bias.shape, generator=gen))


def make(kind: str, d, **over):
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM
    return tiny_hf(Glm4MoeForCausalLM, Glm4MoeConfig, {**BASE, **VARIANTS[kind], **over},
                   d, 4330, randomize=randomize)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_all(tmp_path_factory, "glm4_moe", VARIANTS, make)


def test_published_names_and_layer_kinds(models):
    """The checkpoint has the published tensor names (per expert, the router's weight and its
    correction bias, the shared experts; q/k norms only in GLM-4.5's form) and the plan reads
    them: the first layer dense, the others MoE, the kind carrying the q/k norm where the config
    says so, the rotary dims 16 of 32; no fused expert tensor is read."""
    for kind, (d, _) in models.items():
        names = set(checkpoint_tensors(d))
        assert "model.layers.1.mlp.experts.7.gate_proj.weight" in names
        assert "model.layers.1.mlp.gate.e_score_correction_bias" in names
        assert "model.layers.2.mlp.shared_experts.down_proj.weight" in names
        assert "model.layers.0.self_attn.v_proj.bias" in names
        assert not any("gate_up_proj" in n for n in names)
        assert ("model.layers.0.self_attn.q_norm.weight" in names) == (kind == "glm45")
        plan, _ = plan_and_weights(d)
        repeat = next(e for e in plan["programs"]["decode"] if "repeat" in e)
        suffix = "_qknorm" if kind == "glm45" else ""
        assert repeat["schedule"] == ["dense" + suffix, "moe" + suffix, "moe" + suffix], kind
        assert plan["config"]["R"] == 16 and plan["config"]["D"] == 32
        assert plan["weights"]["router_bias"]["layers"] == [1, 2]
        assert plan["weights"]["router_bias"]["dtype"] == "f32"
        assert ("q_norm" in plan["weights"]) == (kind == "glm45")
        routes = [n for n in json.dumps(plan["programs"]["prefill"]).split('"op": ') if n.startswith('"moe_route')]
        assert routes and all('"scoring": "sigmoid"' in n and '"has_bias": true' in n for n in routes)


@pytest.mark.parametrize("kind", list(VARIANTS))
def test_logits_and_greedy_match_hf(models, kind):
    d, hf = models[kind]
    want = hf_logits(hf, PROMPT)
    plan, weights = plan_and_weights(d)
    assert_logits(plan, weights, want, PROMPT)
    greedy = hf_greedy(hf, PROMPT, 16, VOCAB - 1)
    assert reference_greedy(plan, weights, PROMPT, 16) == greedy


def hf_routes(hf, ids) -> list:
    """HF's chosen experts (sorted, per token) in each MoE layer (one whose mlp has a `gate`: a
    DeepSeek-V3-style router returning (scores, weights, ids)) for the prompt."""
    out = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, o: out.append(np.sort(o[2].numpy(), -1)))
             for layer in hf.model.layers if hasattr(layer.mlp, "gate")]
    try:
        hf_logits(hf, ids)
    finally:
        for h in hooks:
            h.remove()
    return out


def test_the_router_features_bite(models):
    """What the model tests rest on: on this prompt, HF's choices move when the correction bias is
    zeroed or the group limit lifted (so a spec that lost either would choose differently), and
    the reference's logits move when its correction bias is zeroed."""
    d, hf = models["glm45"]
    base = hf_routes(hf, PROMPT)
    for change in ("bias", "groups"):
        other = copy.deepcopy(hf)
        for layer in other.model.layers[1:]:
            if change == "bias":
                layer.mlp.gate.e_score_correction_bias.zero_()
            else:
                layer.mlp.gate.topk_group = layer.mlp.gate.num_group
        moved = sum(int((a != b).any(-1).sum()) for a, b in zip(base, hf_routes(other, PROMPT)))
        assert moved >= 3, (change, moved)
    plan, weights = plan_and_weights(d)
    got = ReferenceExecutor(plan, weights).step([SeqChunk(0, PROMPT, 0)])
    zeroed = dict(weights, router_bias=[np.zeros_like(w) for w in weights["router_bias"]]
                  if isinstance(weights["router_bias"], list) else np.zeros_like(weights["router_bias"]))
    other = ReferenceExecutor(plan, zeroed).step([SeqChunk(0, PROMPT, 0)])
    assert np.abs(got - other).max() > 1e-3


def test_config_without_partial_rotary_factor_defaults_to_half(models, tmp_path):
    """HF's Glm4MoeConfig sets partial_rotary_factor 0.5 when config.json has none (the published
    configs give it at the top level, transformers 5 writes it into rope_parameters): the spec
    reads it from either place and defaults to 0.5."""
    d, _ = models["glm45"]
    c = json.loads((d / "config.json").read_text())
    for where in ("top", "absent"):
        rp = {k: v for k, v in c["rope_parameters"].items() if k != "partial_rotary_factor"}
        cfg = {**c, "rope_parameters": rp}
        if where == "top":
            cfg["partial_rotary_factor"] = 0.25
        out = tmp_path / where
        out.mkdir()
        (out / "config.json").write_text(json.dumps(cfg))
        _, plan = compile_model(model_dir=str(out), check_checkpoint=False)
        assert plan["config"]["R"] == (8 if where == "top" else 16), where


@pytest.mark.parametrize("variant", ["glm-4.5-air", "glm-4.5"])
def test_published_variants_agree_with_hf(variant):
    """Each variant (published config.json values, no weights) builds, and what the plan derives
    agrees with what transformers derives from the same values: the dense / MoE layer kinds, the
    q/k norm, the head and rotary dims, the shared experts' width; the MTP layer sits at the
    index HF's Glm4MoePreTrainedModel ignores on load."""
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoePreTrainedModel, Glm4MoeRotaryEmbedding
    from infc.compiler.spec import SPECS_DIR, load_spec
    values = dict(load_spec(SPECS_DIR / "glm4_moe.yaml").variants[variant])
    _, plan = compile_model(variant)
    hf = Glm4MoeConfig(**{k: v for k, v in values.items() if k not in ("architectures", "model_type")})
    schedule = next(r for r in plan["programs"]["decode"] if "repeat" in r)["schedule"]
    assert schedule == [("moe" if i >= hf.first_k_dense_replace else "dense") + ("_qknorm" if hf.use_qk_norm else "")
                        for i in range(hf.num_hidden_layers)]
    c = plan["config"]
    assert c["D"] == hf.head_dim and c["R"] == 2 * Glm4MoeRotaryEmbedding(hf).inv_freq.numel() == 64
    assert c["Fs"] == hf.moe_intermediate_size * hf.n_shared_experts
    assert (c["rsf"], c["norm_topk"], c["n_group"], c["topk_group"]) == \
        (hf.routed_scaling_factor, hf.norm_topk_prob, hf.n_group, hf.topk_group)
    assert rf"model\.layers\.{hf.num_hidden_layers}.*" in Glm4MoePreTrainedModel._keys_to_ignore_on_load_unexpected
    assert plan["weights"]["bq_bk_bv"]["shape"] == [(hf.num_attention_heads + 2 * hf.num_key_value_heads) * hf.head_dim]


def test_config_defaults_are_hf(models, tmp_path):
    """A config.json without the optional keys binds to the values HF's Glm4MoeConfig gives them
    (partial_rotary_factor 0.5, one shared expert, the first layer dense, ungrouped, unscaled,
    norm_topk_prob true, eps 1e-5, theta 10000, no biases, no q/k norm, head_dim hidden / heads)."""
    from transformers import Glm4MoeConfig
    d, _ = models["glm45"]
    c = json.loads((d / "config.json").read_text())
    keep = ("architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
            "moe_intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "n_routed_experts", "num_experts_per_tok", "max_position_embeddings")
    cfg = {k: c[k] for k in keep}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    _, plan = compile_model(model_dir=str(tmp_path), check_checkpoint=False)
    hf = Glm4MoeConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    got = plan["config"]
    assert got["D"] == 96 // 4 and got["R"] == 2 * len(range(0, int(24 * 0.5), 2)) == 12
    assert (got["n_shared"], got["first_dense"], got["n_group"], got["topk_group"], got["rsf"], got["norm_topk"],
            got["eps"], got["theta"], got["attn_bias"], got["qk_norm"], got["tie"], got["act"]) == \
        (hf.n_shared_experts, hf.first_k_dense_replace, hf.n_group, hf.topk_group, hf.routed_scaling_factor,
         hf.norm_topk_prob, hf.rms_norm_eps, hf.rope_parameters["rope_theta"], hf.attention_bias,
         hf.use_qk_norm, hf.tie_word_embeddings, hf.hidden_act)
    assert hf.rope_parameters["partial_rotary_factor"] == 0.5


# -- through the generated kernels (interpreted) ---------------------------------------------------

def check_kernels(d, hf, tmp_path, fuse):
    """tests/test_families_interp.py's check: a 21-token prefill, a second sequence sharing its
    first page that prefills only its tail, then two batched decode steps (the second through the
    wide program); bf16 kernels within max(2e-2, twice HF's own bf16 error) of the reference."""
    from interp_protocol import bf16_tolerance, executors, sequences, through_kernels
    plan, run, ref = executors(d, tmp_path / "art", fuse)
    a, b = sequences(VOCAB)
    through_kernels(plan, run, ref, a, b, bf16_tolerance(hf))


@pytest.mark.parametrize("kind,fuse", [
    ("glm45", True),
    pytest.param("glm45", False, marks=EXHAUSTIVE),
    pytest.param("air", True, marks=EXHAUSTIVE),
    pytest.param("air", False, marks=EXHAUSTIVE),
], ids=["glm45-fused", "glm45-no-fuse", "air-fused", "air-no-fuse"])
def test_through_kernels(models, kind, fuse, tmp_path):
    check_kernels(*models[kind], tmp_path, fuse)


@pytest.mark.parametrize("kind", ["glm45", pytest.param("air", marks=EXHAUSTIVE)])
def test_narrow_program_through_kernels(models, kind, tmp_path):
    """One sequence's decode steps through the narrow program (the norms merged into the GEMVs),
    then the wide one (tests/test_deepseek_v2_interp.py's check)."""
    from test_deepseek_v2_interp import check_through_kernels
    check_through_kernels(*models[kind], tmp_path)


# -- the MTP layer as published -------------------------------------------------------------------

L = 3                                     # the target's layers; layer L is the MTP block


def make_with_mtp(d, kind="glm45"):
    """The published layout: the model with L + 1 layers, whose last becomes the MTP layer's
    decoder block (model.layers.{L}.*, an MoE layer) with enorm, hnorm, eh_proj, shared_head
    (norm, head) and embed_tokens (the last two copies of the model's), config.json saying L
    layers and one MTP layer; returns the HF model of L + 1 layers."""
    from test_spec_mtp import _save
    full = make(kind, d, num_hidden_layers=L + 1)
    t, c = checkpoint_tensors(d), json.loads((d / "config.json").read_text())
    rng = np.random.default_rng(5)
    H, p = BASE["hidden_size"], f"model.layers.{L}."
    for n in ("enorm", "hnorm", "shared_head.norm"):
        t[p + n + ".weight"] = (1 + 0.3 * rng.standard_normal(H)).astype(np.float32)
    t[p + "eh_proj.weight"] = (0.15 * rng.standard_normal((H, 2 * H))).astype(np.float32)
    t[p + "embed_tokens.weight"] = t["model.embed_tokens.weight"]
    t[p + "shared_head.head.weight"] = t["lm_head.weight"]
    _save(d, t, {**c, "num_hidden_layers": L, "num_nextn_predict_layers": 1})
    return full


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("mtp-glm4_moe")
    return d, make_with_mtp(d)


def test_checkpoint_with_mtp_layer_builds_and_matches_hf(mtp_model):
    """The model's own plan leaves model.layers.{L}.* unread (mtp.target_ignore) and gives HF's
    logits (HF loads the first L layers of the same directory) at every position."""
    from transformers import Glm4MoeForCausalLM
    d, _ = mtp_model
    names = checkpoint_tensors(d)
    assert "model.layers.3.eh_proj.weight" in names
    assert "model.layers.3.mlp.experts.0.up_proj.weight" in names
    hf = Glm4MoeForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    hf.set_attn_implementation("eager")
    assert len(hf.model.layers) == L
    plan, weights = plan_and_weights(d)
    assert not any("eh_proj" in json.dumps(w["source"]) for w in plan["weights"].values())
    assert_logits(plan, weights, hf_logits(hf, PROMPT), PROMPT)


def test_mtp_layer_without_its_ignore_is_refused(mtp_model, tmp_path):
    """Without mtp.target_ignore, the MTP layer's tensors are unread tensors and the build fails
    naming one: the ignore is what lets the published checkpoint build."""
    from infc.compiler.contract.errors import SpecError
    from infc.compiler.spec import SPECS_DIR
    d, _ = mtp_model
    text = (SPECS_DIR / "glm4_moe.yaml").read_text()
    old = '  target_ignore:              # the model\'s own plan leaves the MTP layer unread\n    - "model.layers.{L}.*"\n'
    assert old in text
    (tmp_path / "glm4_moe.yaml").write_text(text.replace(old, ""))
    with pytest.raises(SpecError, match=r"model\.layers\.3\."):
        compile_model(model_dir=str(d), spec_path=str(tmp_path / "glm4_moe.yaml"))


class GlmReference:
    """The MTP layer from its definition over HF's modules (tests/test_spec_mtp.py's
    DeepseekReference with GLM's RMSNorm): h the target's final-normed hidden state,
    x = eh_proj(concat(enorm(embed(t + 1)), hnorm(h))), HF's decoder layer L, shared_head.norm,
    lm_head; chained rows feed the layer's output before the norm."""
    def __init__(self, full, d):
        from test_spec_mtp import _Reference
        from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeRMSNorm
        t = checkpoint_tensors(d)
        H, eps = full.config.hidden_size, full.config.rms_norm_eps
        p = f"model.layers.{L}."

        def norm(name):
            n = Glm4MoeRMSNorm(H, eps)
            n.weight.data = torch.from_numpy(t[p + name + ".weight"])
            return n
        self.base = _Reference()
        self.base.m = full.model
        self.enorm, self.hnorm, self.head_norm = norm("enorm"), norm("hnorm"), norm("shared_head.norm")
        self.eh_proj = torch.from_numpy(t[p + "eh_proj.weight"])
        self.lm_head, self.m = full.lm_head, full.model

    def target_hidden(self, toks):
        x = self.base._layers(self.m.embed_tokens(torch.tensor([toks])), self.m.layers[:L])
        return self.m.norm(x)[0]

    def mtp(self, ids, h):
        e = self.enorm(self.m.embed_tokens(torch.tensor([ids])))
        x = torch.cat([e, self.hnorm(h[None])], -1) @ self.eh_proj.T
        x = self.base._layers(x, [self.m.layers[L]])[0]
        return x, self.lm_head(self.head_norm(x))


def _engine(d, spec=None):
    from infc.backend import load_backend
    from infc.compiler.spec import SPECS_DIR
    kw = dict(device="cpu", max_num_seqs=16, log=None, num_gpu_blocks_override=64,
              spec=str(SPECS_DIR / "glm4_moe.yaml"))
    if spec:
        kw["speculative_config"] = spec
    e = load_backend(d, **kw).engine
    return getattr(e, "engine", e)


def test_mtp_drafts_equal_the_reference_and_greedy_is_plain(mtp_model):
    """tests/test_spec_mtp.py's check on GLM's MTP layer: the engine's proposals for the first
    request are the reference's drafts for its tokens at that moment, the last chained hidden
    state the reference's, and the output is plain decoding's."""
    from test_spec_mtp import MTP, PROMPTS, _run, reference_drafts
    d, full = mtp_model
    ref = GlmReference(full, d)
    e = _engine(d, MTP)
    prop, seen = e.spec.draft, []
    propose = prop.propose

    def recording(wants, row_at=None):
        out = propose(wants, row_at)
        made = [s for s, _ in wants if s.seq_id in out]
        if len({len(out[s.seq_id]) for s in made}) == 1:
            last = prop.runner.outputs()["hidden_out"]
            seen.extend((list(s.token_ids), out[s.seq_id], last[b].copy())
                        for b, s in enumerate(made) if s.request_id == "r0")
        return out
    prop.propose = recording
    got, _ = _run(e, PROMPTS, n=8)
    plain, _ = _run(_engine(d), PROMPTS, n=8)
    assert got == plain
    assert len(seen) >= 3
    for toks, drafts, last in seen[:4]:
        want, hidden = reference_drafts(ref, toks, len(drafts))
        assert drafts == want, toks
        np.testing.assert_allclose(last, hidden, rtol=1e-4, atol=1e-4)
    assert e.metrics.spec_decode_num_draft_tokens_total > 0
    assert prop.held_pages() == 0 and not prop.shadows
