"""GraniteMoeShared (specs/granitemoe.yaml: GraniteMoeSharedForCausalLM, model_type
granitemoeshared) against transformers' own model: tests/test_granitemoe.py's tiny Granite MoE
(its g30 form: Granite's four scalars away from 1, tied lm_head, top-2 of 8 experts of width 32)
with the shared MLP HF adds to the routed sum before the residual multiplier, saved with
save_pretrained (the published names: shared_mlp.input_linear [2Fs, H], gate | up, and
shared_mlp.output_linear [H, Fs]):
  shared: Fs 64, twice the experts' width (the compiler folds it into two always-on experts,
          compiler/passes/fold_shared_experts.py), attention biases on
  odd:    Fs 48, no multiple of the experts' width (stays a plain SwiGLU beside the experts)
  none:   shared_intermediate_size 0 (HF's default): HF builds no shared MLP, and neither does
          the plan (GraniteMoe's routed layers)
Every RMSNorm weight and bias is random (HF initializes them to 1 and 0).

The reference executor must give HF's (eager, float32) logits at every position of a 24-token
prompt within 1e-4, as 24 prefixes in one step and one token a step, and the same 16 greedy
tokens as generate(); the generated kernels under the interpreter, fused and --no-fuse, match the
reference; the shared MLP, its gate | up order and its residual multiplier each bite.
"""
import json

import numpy as np
import pytest
import torch

from infc.runtime.reference.executor import ReferenceExecutor, SeqChunk

from exhaustive import EXHAUSTIVE
from families import checkpoint_tensors, hf_greedy, hf_logits, plan_and_weights, reference_greedy
from test_deepseek_v2 import PROMPT, TOL, VOCAB, assert_logits, make_all
from test_glm4_moe import check_kernels
from test_granitemoe import BASE, VARIANTS as MOE_VARIANTS, broken_logits, legacy_config, randomize

VARIANTS = {
    "shared": dict(shared_intermediate_size=64, attention_bias=True),
    "odd": dict(shared_intermediate_size=48),
    "none": dict(shared_intermediate_size=0),
}


def make(kind: str, d, **over):
    from transformers import GraniteMoeSharedConfig, GraniteMoeSharedForCausalLM
    torch.manual_seed(4331)
    cfg = {**BASE, **MOE_VARIANTS["g30"], **VARIANTS[kind], **over}
    model = GraniteMoeSharedForCausalLM(GraniteMoeSharedConfig(**cfg)).float().eval()
    model.set_attn_implementation("eager")
    randomize(model)
    model.save_pretrained(d)        # save_original_format=True (the default): the published names
    legacy_config(d)
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_all(tmp_path_factory, "granitemoeshared", VARIANTS, make)


def routes(plan) -> list:
    """The moe_route launches' JSON in the prefill program."""
    return [n for n in json.dumps(plan["programs"]["prefill"]).split('"op": ') if n.startswith('"moe_route')]


def test_published_names_and_plan(models):
    """The checkpoint has the published names (shared_mlp.input_linear [2Fs, H], output_linear
    [H, Fs] beside the experts' input_linear / output_linear; no shared MLP where its width is 0)
    and the plan reads them: the shared kind in every layer where Fs > 0, Fs bound per kind; the
    64-wide shared MLP folded into 2 always-on experts of 32, the 48-wide one not."""
    for kind, (d, hf) in models.items():
        tensors = checkpoint_tensors(d)
        fs = VARIANTS[kind]["shared_intermediate_size"]
        assert tensors["model.layers.1.block_sparse_moe.input_linear.weight"].shape == (8, 64, 96)
        if fs:
            assert tensors["model.layers.1.shared_mlp.input_linear.weight"].shape == (2 * fs, 96)
            assert tensors["model.layers.0.shared_mlp.output_linear.weight"].shape == (96, fs)
        else:
            assert not any("shared_mlp" in n for n in tensors)
            assert all(layer.shared_mlp is None for layer in hf.model.layers)
        plan, _ = plan_and_weights(d)
        repeat = next(e for e in plan["programs"]["decode"] if "repeat" in e)
        assert repeat["schedule"] == ["shared" if fs else "routed"] * 2, kind
        assert plan["config"]["has_shared"] == bool(fs)
        folded = [r for r in routes(plan) if '"shared": 2' in r]
        assert bool(folded) == (kind == "shared"), (kind, routes(plan))


@pytest.mark.parametrize("kind", list(VARIANTS))
def test_logits_and_greedy_match_hf(models, kind):
    d, hf = models[kind]
    want = hf_logits(hf, PROMPT)
    plan, weights = plan_and_weights(d)
    assert_logits(plan, weights, want, PROMPT)
    greedy = hf_greedy(hf, PROMPT, 16, VOCAB - 1)
    assert reference_greedy(plan, weights, PROMPT, 16) == greedy


def test_the_shared_mlp_bites(models):
    """The shared MLP's contribution is seen: with its down projection zeroed the reference is far
    from HF's logits (--no-fuse plan: the shared MLP its own weights, not folded into the stacks)."""
    d, hf = models["shared"]
    plan, weights = plan_and_weights(d, fuse=False)
    assert "ws_down" in plan["weights"]
    zeroed = dict(weights, ws_down=[np.zeros_like(w) for w in weights["ws_down"]]
                  if isinstance(weights["ws_down"], list) else np.zeros_like(weights["ws_down"]))
    got = ReferenceExecutor(plan, zeroed).step([SeqChunk(0, PROMPT, 0)])
    assert np.abs(got - hf_logits(hf, PROMPT)).max() > 100 * TOL


BREAKS = {
    # shared_mlp.input_linear's first Fs rows are the gate, the last Fs the up projection
    "shared_gate_up_order": [("shape: [Fs, H], rows: [0, Fs]}", "shape: [Fs, H], rows: [@]}", 1),
                             ("shape: [Fs, H], rows: [Fs, 2*Fs]}", "shape: [Fs, H], rows: [0, Fs]}", 1),
                             ("rows: [@]}", "rows: [Fs, 2*Fs]}", 1)],
    # (routed + shared) * residual_multiplier: the shared MLP's output is scaled too
    "shared_residual_multiplier": [("shape: [H, Fs], scale: res_mult}", "shape: [H, Fs]}", 1)],
}


@pytest.mark.parametrize("kind", ["shared", "odd"])
@pytest.mark.parametrize("name", list(BREAKS))
def test_each_shared_feature_bites(models, tmp_path, name, kind):
    """With one feature of the shared MLP taken away (folded into the experts or not) the logits
    are far (> 100 x TOL) from HF's at some position."""
    d, hf = models[kind]
    got = broken_logits(d, tmp_path, *BREAKS[name])
    assert np.abs(got - hf_logits(hf, PROMPT)).max() > 100 * TOL, name


def test_config_defaults_are_hf(models, tmp_path):
    """A GraniteMoeShared config.json without shared_intermediate_size has HF's default, 0: no
    shared MLP (GraniteMoeSharedConfig's docstring says 1024, its field 0, and the model reads the
    field)."""
    from transformers import GraniteMoeSharedConfig
    from infc.compiler.build import compile_model
    d, _ = models["none"]
    c = json.loads((d / "config.json").read_text())
    c.pop("shared_intermediate_size")
    (tmp_path / "config.json").write_text(json.dumps(c))
    _, plan = compile_model(model_dir=str(tmp_path), check_checkpoint=False)
    hf = GraniteMoeSharedConfig(**{k: v for k, v in c.items() if k not in ("architectures", "model_type")})
    assert plan["config"]["shared_size"] == hf.shared_intermediate_size == 0
    assert not plan["config"]["has_shared"]


# -- through the generated kernels (interpreted) ---------------------------------------------------

@pytest.mark.parametrize("kind,fuse", [
    ("shared", True),
    pytest.param("shared", False, marks=EXHAUSTIVE),
    pytest.param("odd", True, marks=EXHAUSTIVE),
    pytest.param("odd", False, marks=EXHAUSTIVE),
], ids=["shared-fused", "shared-no-fuse", "odd-fused", "odd-no-fuse"])
def test_through_kernels(models, kind, fuse, tmp_path):
    check_kernels(*models[kind], tmp_path, fuse)


@pytest.mark.parametrize("kind", [pytest.param("shared", marks=EXHAUSTIVE), pytest.param("odd", marks=EXHAUSTIVE)])
def test_narrow_program_through_kernels(models, kind, tmp_path):
    """One sequence's decode steps through the narrow program (the norms merged into the GEMVs),
    then the wide one (tests/test_deepseek_v2_interp.py's check)."""
    from test_deepseek_v2_interp import check_through_kernels
    check_through_kernels(*models[kind], tmp_path)
