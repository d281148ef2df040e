"""Every spec family against HF transformers (float32, CPU) on a tiny random model of it
(tests/families.py): the plan `infc build --model-path DIR` makes, run by the numpy reference
executor, gives HF's logits at every position of a 16-token prompt within 1e-4, and the same 16
greedy tokens as HF's generate.

Every position is checked twice, for the fused plan and the `--no-fuse` plan: as 16 prefills of the prompt's prefixes batched in one step
(the prefill path: windows, soft caps and kinds over many query rows at once) and as the prompt
fed one token per step (the decode path over a growing cache). A chunked prefill (a mixed step
next to a decoding sequence) checks the cached-prefix path. Each family's tiny config makes its
features bite: dropping any of them (a bias, an offset, a window, a soft cap, a scale, a
rotary_dim, a kind's RoPE base) moves these logits by 1e-3 or (mostly) far more.
"""
from pathlib import Path

import numpy as np
import pytest
import torch

from infc.compiler.build import compile_model
from infc.compiler.spec import load_spec
from infc.runtime.reference.executor import ReferenceExecutor, SeqChunk
from infc.compiler.contract.safetensors_io import Checkpoint
from infc.runtime.weights.load import load_weights

from families import FAMILIES, VOCAB, reference_greedy

TOL = 1e-4
SPECS = Path(__file__).resolve().parent.parent / "specs"
MODEL_TYPE = {"gemma3": "gemma3_text"}      # HF model_type where it is not the family name
PROMPT = [int(t) for t in np.random.default_rng(7).integers(0, VOCAB, 16)]


def _plan_and_weights(d, fuse=True):
    # what `infc build --model-path d [--no-fuse]` plans
    _, plan = compile_model(model_dir=str(d), fuse=fuse)
    return plan, load_weights(plan, Checkpoint(d))


def _hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "no-fuse"])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_at_every_position(family, fuse, family_model):
    d, hf = family_model(family)
    want = _hf_logits(hf, PROMPT)
    plan, weights = _plan_and_weights(d, fuse)

    # prefill: one step of 16 sequences, the prompt's prefixes of lengths 1..16
    ex = ReferenceExecutor(plan, weights)
    got = ex.step([SeqChunk(n, PROMPT[:n], 0) for n in range(1, len(PROMPT) + 1)])
    err = np.abs(got - want).max(axis=1)
    assert err.max() <= TOL, f"prefill: worst position {int(err.argmax())}, |diff| {err.max():.2e}"

    # decode: one token per step
    ex = ReferenceExecutor(plan, weights)
    err = [float(np.abs(ex.step([SeqChunk(0, [t], pos)])[0] - want[pos]).max())
           for pos, t in enumerate(PROMPT)]
    assert max(err) <= TOL, f"decode: worst position {int(np.argmax(err))}, |diff| {max(err):.2e}"


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_next_to_a_decode(family, family_model):
    """The prompt in two chunks (7 + 9 tokens), the second in a mixed step with a decode."""
    d, hf = family_model(family)
    other = PROMPT[::-1][:5]
    plan, weights = _plan_and_weights(d)
    ex = ReferenceExecutor(plan, weights)
    ex.step([SeqChunk(0, PROMPT[:7], 0), SeqChunk(1, other[:4], 0)])
    got = ex.step([SeqChunk(0, PROMPT[7:], 7), SeqChunk(1, other[4:], 4)])
    assert np.abs(got[0] - _hf_logits(hf, PROMPT)[-1]).max() <= TOL
    assert np.abs(got[1] - _hf_logits(hf, other)[-1]).max() <= TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_16_tokens_match_hf(family, family_model):
    d, hf = family_model(family)
    with torch.no_grad():
        want = hf.generate(torch.tensor([PROMPT]), max_new_tokens=16, min_new_tokens=16,
                           do_sample=False, pad_token_id=0)[0, len(PROMPT):].tolist()
    plan, weights = _plan_and_weights(d)
    assert reference_greedy(plan, weights, PROMPT, 16) == want


def test_ignore_is_what_lets_stablelm_build(family_model, tmp_path):
    """stablelm's tiny checkpoint carries each layer's rotary_emb.inv_freq buffer (as checkpoints
    saved by transformers < 4.31 do): the spec's `ignore:` pattern accounts for them, and
    without it the build names the unread tensor."""
    from infc.compiler.contract.errors import SpecError
    d, _ = family_model("stablelm")
    spec = (SPECS / "stablelm.yaml").read_text()
    cut = spec.replace('ignore:\n  - "model.layers.*.self_attn.rotary_emb.inv_freq"\n', "")
    assert cut != spec
    (tmp_path / "stablelm.yaml").write_text(cut)
    with pytest.raises(SpecError, match=r"rotary_emb\.inv_freq"):
        compile_model(model_dir=str(d), spec_path=str(tmp_path / "stablelm.yaml"))


@pytest.mark.parametrize("family", FAMILIES)
def test_published_variants_build(family):
    """Every variant (published config.json values) builds with no weights, and its layer kinds
    are the ones transformers derives from the same config (layer_types)."""
    from transformers import AutoConfig
    spec = load_spec(SPECS / f"{family}.yaml")
    assert spec.variants
    for name, values in spec.variants.items():
        _, plan = compile_model(name, spec_path=str(SPECS / f"{family}.yaml"))
        hf = AutoConfig.for_model(MODEL_TYPE.get(family, family), **dict(values))
        schedule = next(r for r in plan["programs"]["decode"] if "repeat" in r)["schedule"]
        if set(schedule) <= {"full_attention", "sliding_attention"}:
            assert schedule == list(hf.layer_types), name
        if family == "smollm3":
            assert schedule == ["rope" if r else "nope" for r in hf.no_rope_layers], name
