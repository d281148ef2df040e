"""Llama-4's MoE layers in specs/llama4.yaml, against transformers on tiny random float32 models:
  - maverick-like (Llama4ForCausalLM): 4 layers, MoE every other one (interleave_moe_layer_step
    2: layers 1 and 3, a dense layer between them), no_rope_layers [1, 1, 0, 0]: the kinds
    rope_qk, rope_qk_moe, nope, nope_moe; the weightless q/k norm;
  - scout-like (Llama4ForConditionalGeneration, vision tower and projector ignored; config under
    text_config, weights under language_model.*): 3 layers, every one MoE (step 1), no q/k norm,
    NoPE every 3rd layer: rope_moe, rope_moe, nope_moe.
Both: chunked attention (chunk 6 < the 16-token prompt), NoPE layers with the query temperature
(floor 4, so it grows over the prompt), 4 experts top-1 with the sigmoid router weight on the
expert's INPUT, the shared expert, norms random. Through the reference executor: logits at every
position within 1e-4 (16 prefills batched, and one token a step), 16 greedy tokens = HF's
generate; weighing the expert's output instead moves the logits. Through the interpreted kernels
(fused and --no-fuse, --exhaustive): a prefill crossing a page, a prefix hit, two batched decodes,
on a variant of each model whose top-1 routing is decisive by construction (bf16 rounding flipped
near-tied choices of the random routers: another expert's output, not a kernel's error).
The published variants' layer schedules (Scout MoE everywhere, Maverick interleaved).
"""

import numpy as np
import pytest
import torch

from infc.compiler.build import compile_model
from infc.compiler.contract.safetensors_io import Checkpoint
from infc.runtime.reference.executor import ReferenceExecutor, SeqChunk
from infc.runtime.weights.load import load_weights

from exhaustive import EXHAUSTIVE
from families import VOCAB, _randomize, hf_logits, reference_greedy
from interp_protocol import executors, sequences, through_kernels

TOL = 1e-4
PROMPT = [int(t) for t in np.random.default_rng(11).integers(0, VOCAB, 16)]

TEXT = dict(vocab_size=VOCAB, initializer_range=0.05, max_position_embeddings=256, hidden_size=96,
            intermediate_size=64, intermediate_size_mlp=160, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, rms_norm_eps=1e-5, num_local_experts=4, num_experts_per_tok=1,
            attention_chunk_size=6, attn_temperature_tuning=True, floor_scale=4, attn_scale=0.5,
            tie_word_embeddings=False, pad_token_id=0,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def _maverick_like():
    from transformers import Llama4ForCausalLM, Llama4TextConfig
    return Llama4ForCausalLM(Llama4TextConfig(
        **TEXT, num_hidden_layers=4, interleave_moe_layer_step=2, no_rope_layers=[1, 1, 0, 0],
        use_qk_norm=True))


def _scout_like():
    from transformers import Llama4Config, Llama4ForConditionalGeneration
    text = dict(TEXT, num_hidden_layers=3, interleave_moe_layer_step=1, no_rope_layer_interval=3,
                use_qk_norm=False)
    vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                  image_size=56, patch_size=14, vision_output_dim=64, projector_input_dim=64,
                  projector_output_dim=96, pixel_shuffle_ratio=0.5)
    return Llama4ForConditionalGeneration(Llama4Config(text_config=text, vision_config=vision,
                                                       tie_word_embeddings=False))


BUILDERS = {"maverick-like": _maverick_like, "scout-like": _scout_like}
SCHEDULES = {"maverick-like": ["rope_qk", "rope_qk_moe", "nope", "nope_moe"],
             "scout-like": ["rope_moe", "rope_moe", "nope_moe"]}


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    cache = {}

    def get(name, decisive=False):
        """decisive: the kernels' fixture (test_through_kernels), whose routing no bf16 rounding
        flips; the HF comparisons take the plain random one."""
        if (name, decisive) not in cache:
            torch.manual_seed(4321)
            model = BUILDERS[name]().float().eval()
            model.set_attn_implementation("eager")
            _randomize(model)
            gen = torch.Generator().manual_seed(5)
            with torch.no_grad():
                params = dict(model.named_parameters())
                u = None
                if decisive:
                    # decisive routing by construction: token v's embedding carries a planted
                    # direction U[v % E] (15x its random part) and router row e reads U[e], so
                    # token v's top-1 is expert v % E by a clear margin (every expert used;
                    # test_fixture_routes_decisively), where bf16's rounding moves a logit by
                    # ~0.05: the interpreted bf16 kernels and the float32 reference choose the
                    # same expert (with random routers, near-ties flip: top-1 routing turns one
                    # rounding into another expert's output)
                    emb = next(p for n, p in params.items() if n.endswith("embed_tokens.weight"))
                    n_exp = TEXT["num_local_experts"]
                    u = torch.linalg.qr(torch.randn(emb.shape[1], n_exp, generator=gen))[0].T
                    emb += 15 * emb.norm(dim=1).mean() * u[torch.arange(emb.shape[0]) % n_exp]
                for pname, p in params.items():
                    if "router" in pname:      # logits of a few units: sigmoid weights well inside (0, 1)
                        p.copy_(0.3 * torch.randn(p.shape, generator=gen) if u is None
                                else 0.3 * u + 0.03 * torch.randn(p.shape, generator=gen))
                    elif "experts." in pname:  # (HF leaves the fused expert parameters zeros / empty)
                        p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            d = tmp_path_factory.mktemp(f"llama4-{name}{'-decisive' if decisive else ''}")
            model.save_pretrained(d)
            cache[name, decisive] = (d, model)
        return cache[name, decisive]
    return get


def _prefills(plan, weights):
    return ReferenceExecutor(plan, weights).step([SeqChunk(n, PROMPT[:n], 0) for n in range(1, len(PROMPT) + 1)])


def test_checkpoints_hold_what_the_test_means(moe_model):
    """The tiny models' layers are those the module docstring names (HF's own layer rule)."""
    d, hf = moe_model("maverick-like")
    assert [lay.is_moe_layer for lay in hf.model.layers] == [False, True, False, True]
    assert [lay.self_attn.use_rope for lay in hf.model.layers] == [1, 1, 0, 0]
    d, hf = moe_model("scout-like")
    text = hf.language_model.model              # Llama4ForConditionalGeneration.language_model
    assert [lay.is_moe_layer for lay in text.layers] == [True, True, True]
    assert [lay.self_attn.use_rope for lay in text.layers] == [1, 1, 0]
    from safetensors import safe_open
    names = set()
    for f in d.glob("*.safetensors"):
        with safe_open(str(f), "np") as st:
            names |= set(st.keys())
    assert any(n.startswith("vision_model.") for n in names)
    assert any(n.startswith("language_model.model.layers.0.feed_forward.experts.gate_up_proj") for n in names)


@pytest.mark.parametrize("name", list(BUILDERS))
def test_schedule(name, moe_model):
    _, plan = compile_model(model_dir=str(moe_model(name)[0]))
    rep = next(r for r in plan["programs"]["prefill"] if "repeat" in r)
    assert rep["schedule"] == SCHEDULES[name]


@pytest.mark.parametrize("name,fuse", [
    pytest.param(n, fuse, id=f"{n}-{'fused' if fuse else 'no-fuse'}", marks=() if fuse else EXHAUSTIVE)
    for n in BUILDERS for fuse in (True, False)])
def test_reference_matches_hf(name, fuse, moe_model):
    d, hf = moe_model(name)
    want = hf_logits(hf, PROMPT)
    _, plan = compile_model(model_dir=str(d), fuse=fuse)
    weights = load_weights(plan, Checkpoint(d))
    got = _prefills(plan, weights)
    err = np.abs(got - want).max(axis=1)
    assert err.max() <= TOL, f"prefill: worst position {int(err.argmax())}, |diff| {err.max():.2e}"
    ex = ReferenceExecutor(plan, weights)
    err = [float(np.abs(ex.step([SeqChunk(0, [t], pos)])[0] - want[pos]).max()) for pos, t in enumerate(PROMPT)]
    assert max(err) <= TOL, f"decode: worst position {int(np.argmax(err))}, |diff| {max(err):.2e}"
    if fuse:
        assert reference_greedy(plan, weights, PROMPT, 16) == hf.generate(
            input_ids=torch.tensor([PROMPT]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
            pad_token_id=0)[0, len(PROMPT):].tolist()


def test_router_weight_on_the_input_is_read(moe_model, tmp_path):
    """Weighing the expert's output instead (Mixtral's way) is another model: the logits move."""
    from pathlib import Path
    d, hf = moe_model("maverick-like")
    spec = Path(__file__).resolve().parents[1] / "specs" / "llama4.yaml"
    text = spec.read_text()
    assert text.count('weigh="input"') == 3
    other = tmp_path / "llama4.yaml"
    other.write_text(text.replace('weigh="input"', 'weigh="output"'))
    _, plan = compile_model(model_dir=str(d), spec_path=str(other))
    moved = _prefills(plan, load_weights(plan, Checkpoint(d)))
    assert np.abs(moved - hf_logits(hf, PROMPT)).max() > 1e-3


@pytest.mark.parametrize("name", list(BUILDERS))
def test_fixture_routes_decisively(name, moe_model):
    """Every routing decision test_through_kernels compares is decisive: HF float32's top-1 router
    logit leads the second by >= 0.25 at every MoE layer and position of its sequences (with their
    greedy continuations), past what bf16's rounding moved a router logit by in the kernels here
    (<= 0.054 over the interpreted steps of a random-router fixture, whose near-ties flipped)."""
    _, hf = moe_model(name, decisive=True)
    logits = []
    hooks = [m.register_forward_hook(lambda m, i, out: logits.append(out[1]))
             for m in hf.modules() if type(m).__name__ == "Llama4Router"]
    try:
        with torch.no_grad():
            for s in sequences(VOCAB):
                for _ in range(2):
                    s = s + [int(hf(input_ids=torch.tensor([s])).logits[0, -1].argmax())]
                logits.clear()
                hf(input_ids=torch.tensor([s]))
                top = torch.cat(logits).float().topk(2, dim=-1).values
                margin = float((top[:, 0] - top[:, 1]).min())
                assert margin >= 0.25, f"a near-tie in the fixture's routing: top-1 margin {margin:.3f}"
    finally:
        for h in hooks:
            h.remove()


@EXHAUSTIVE
@pytest.mark.parametrize("name,fuse", [(n, f) for n in BUILDERS for f in (True, False)],
                         ids=[f"{n}-{'fused' if f else 'no-fuse'}" for n in BUILDERS for f in (True, False)])
def test_through_kernels(name, fuse, moe_model, tmp_path):
    """The build's kernels, interpreted (tests/interp_protocol.py): a 21-token prefill (chunks of 6
    cross the 16-token page), a second sequence reusing the first's first page (a prefix hit) and
    computing only its tail, then two batched decodes, the second a wide step (the experts on the
    grouped GEMMs, weighed on their input); against the reference at bf16's tolerance."""
    d, _ = moe_model(name, decisive=True)
    plan, run, ref = executors(d, tmp_path / "art", fuse)
    through_kernels(plan, run, ref, *sequences(VOCAB), 2e-2)


@pytest.mark.parametrize("variant,schedule", [
    ("llama-4-scout-17b-16e", (["rope_qk_moe"] * 3 + ["nope_moe"]) * 12),
    ("llama-4-maverick-17b-128e", ["rope", "rope_moe", "rope", "nope_moe"] * 12)])
def test_published_variants_schedule(variant, schedule):
    """Scout: MoE in every layer, q/k norm; Maverick: MoE in the odd layers, no q/k norm; NoPE
    every 4th layer in both."""
    _, plan = compile_model(model=variant)
    rep = next(r for r in plan["programs"]["prefill"] if "repeat" in r)
    assert rep["schedule"] == schedule
