"""The attention vocabulary on families infc had no spec for, each written as a spec in specs/ and
checked against transformers on a tiny random float32 model:
  - llama4 (Llama4ForCausalLM, dense): chunked attention on the RoPE layers (chunk 6 < the
    16-token prompt), NoPE layers beside them with Llama-4's query temperature (floor 4, so it
    grows over the prompt), the weightless q/k RMS norm after RoPE;
  - bloom (BloomForCausalLM): ALiBi with 6 heads (no power of two: the interleaved slopes);
  - mpt (MptForCausalLM): ALiBi through `alibi=alibi_bias_max`, q|k|v stacked, weight-only
    LayerNorms (MPT's own max bias other than 8 is checked against MPT's formula in
    tests/kernels/test_attention_mods.py: transformers ignores it).
Through the reference executor: logits at every position within 1e-4 (16 prefills batched, and
one token a step), a chunked prefill beside a decode = one shot, 16 greedy tokens = HF's generate. Through the
interpreted kernels (tests/test_families_interp.py's check): prefill, a prefix hit (the first
page shared, only the tail computed) and two batched decodes against the reference
(--exhaustive); tensor parallelism; the feature backends.
"""
import json

import numpy as np
import pytest
import torch

from infc.compiler.build import build, compile_model
from infc.compiler.contract.errors import SpecError
from infc.compiler.contract.safetensors_io import Checkpoint
from infc.runtime.engine.step import Chunk
from infc.runtime.reference.executor import ReferenceExecutor, SeqChunk
from infc.runtime.weights.load import load_weights

from exhaustive import EXHAUSTIVE
from families import VOCAB, _randomize, reference_greedy
from interp_executor import InterpExecutor

TOL = 1e-4
PROMPT = [int(t) for t in np.random.default_rng(7).integers(0, VOCAB, 16)]


def _llama4():
    from transformers import Llama4ForCausalLM, Llama4TextConfig
    # layers rope, nope (interval 2; published 4); dense MLPs (moe_layers = [])
    return Llama4ForCausalLM(Llama4TextConfig(
        vocab_size=VOCAB, initializer_range=0.05, max_position_embeddings=256, hidden_size=96,
        intermediate_size=64, intermediate_size_mlp=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-5, moe_layers=[], no_rope_layer_interval=2,
        attention_chunk_size=6, attn_temperature_tuning=True, floor_scale=4, attn_scale=0.5,
        use_qk_norm=True, tie_word_embeddings=False, pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}))


def _bloom():
    from transformers import BloomConfig, BloomForCausalLM
    return BloomForCausalLM(BloomConfig(
        vocab_size=VOCAB, initializer_range=0.1, hidden_size=96, n_layer=2, n_head=6,
        layer_norm_epsilon=1e-5, tie_word_embeddings=True))


def _mpt():
    from transformers import MptConfig, MptForCausalLM
    # 6 heads (the interleaved slopes); alibi_bias_max stays 8: transformers ignores it (its
    # MptModel builds the slopes with 8), so another value is refused by the spec
    return MptForCausalLM(MptConfig(
        vocab_size=VOCAB, initializer_range=0.1, d_model=96, n_heads=6, n_layers=2,
        max_seq_len=64, layer_norm_epsilon=1e-5))


BUILDERS = {"llama4": _llama4, "bloom": _bloom, "mpt": _mpt}


@pytest.fixture(scope="module")
def vocab_model(tmp_path_factory):
    cache = {}

    def get(family):
        if family not in cache:
            torch.manual_seed(1234)
            model = BUILDERS[family]().float().eval()
            model.set_attn_implementation("eager")
            _randomize(model)
            d = tmp_path_factory.mktemp(f"vocab-{family}")
            model.save_pretrained(d)
            cache[family] = (d, model)
        return cache[family]
    return get


def _plan_and_weights(d, fuse=True):
    _, plan = compile_model(model_dir=str(d), fuse=fuse)
    return plan, load_weights(plan, Checkpoint(d))


def _hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


# the fast suite: llama4 and bloom fused (mpt's ALiBi is bloom's; its spec with --exhaustive)
@pytest.mark.parametrize("family,fuse", [
    pytest.param(f, fuse, id=f"{f}-{'fused' if fuse else 'no-fuse'}",
                 marks=() if fuse and f != "mpt" else EXHAUSTIVE)
    for f in BUILDERS for fuse in (True, False)])
def test_reference_matches_hf(family, fuse, vocab_model):
    d, hf = vocab_model(family)
    want = _hf_logits(hf, PROMPT)
    plan, weights = _plan_and_weights(d, fuse)
    ex = ReferenceExecutor(plan, weights)
    got = ex.step([SeqChunk(n, PROMPT[:n], 0) for n in range(1, len(PROMPT) + 1)])
    err = np.abs(got - want).max(axis=1)
    assert err.max() <= TOL, f"prefill: worst position {int(err.argmax())}, |diff| {err.max():.2e}"
    ex = ReferenceExecutor(plan, weights)
    err = [float(np.abs(ex.step([SeqChunk(0, [t], pos)])[0] - want[pos]).max()) for pos, t in enumerate(PROMPT)]
    assert max(err) <= TOL, f"decode: worst position {int(np.argmax(err))}, |diff| {max(err):.2e}"
    # a chunked prefill (7 + 9, the second chunk beside a decode) = one shot; the reference has
    # no shared pages, so a prefix hit (shared physical pages) is test_through_kernels' and
    # tests/kernels/test_attention_mods.py's
    ex = ReferenceExecutor(plan, weights)
    other = PROMPT[::-1][:5]
    ex.step([SeqChunk(0, PROMPT[:7], 0), SeqChunk(1, other[:4], 0)])
    got = ex.step([SeqChunk(0, PROMPT[7:], 7), SeqChunk(1, other[4:], 4)])
    assert np.abs(got[0] - want[-1]).max() <= TOL
    assert np.abs(got[1] - _hf_logits(hf, other)[-1]).max() <= TOL
    if fuse:
        assert reference_greedy(plan, weights, PROMPT, 16) == hf.generate(
            torch.tensor([PROMPT]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
            pad_token_id=0)[0, len(PROMPT):].tolist()


def _attention_attrs(d):
    """kind -> the attrs of its attention launches, in the plan `infc build --model-path d` makes."""
    _, plan = compile_model(model_dir=str(d))
    rep = next(r for r in plan["programs"]["prefill"] if "repeat" in r)
    return rep["schedule"], {kind: [lc["attrs"] for lc in body if lc["op"] == "attention_cached"]
                             for kind, body in rep["kinds"].items()}


def test_plans_carry_the_attrs_where_hf_applies_them(vocab_model):
    """The chunk on Llama-4's RoPE layers only, the temperature on its NoPE layers only, ALiBi
    (BLOOM's max bias 8) on every BLOOM layer and nowhere else."""
    schedule, attrs = _attention_attrs(vocab_model("llama4")[0])
    assert schedule == ["rope_qk", "nope"]
    assert [(a.get("chunk"), a.get("temp_floor"), a.get("alibi")) for a in attrs["rope_qk"]] == [(6, None, None)]
    assert [(a.get("chunk"), a.get("temp_floor"), a.get("temp_scale"), a.get("alibi"))
            for a in attrs["nope"]] == [(None, 4, 0.5, None)]
    schedule, attrs = _attention_attrs(vocab_model("bloom")[0])
    assert [(a.get("alibi"), a.get("chunk"), a.get("temp_floor")) for a in attrs["layer"]] == [(8.0, None, None)]


def test_llama4_refuses_more_than_one_expert_a_token(vocab_model, tmp_path):
    """Llama-4's MoE layers (tests/test_llama4_moe.py) weigh the expert's input, which the
    kernels do for one expert a token: a config with num_experts_per_tok 2 fails naming the
    spec's requirement."""
    d, _ = vocab_model("llama4")
    cfg = json.loads((d / "config.json").read_text())
    cfg["moe_layers"], cfg["num_experts_per_tok"] = [1, 3], 2
    for f in d.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SpecError, match=r"llama4.yaml:\d+: .*requirement 'K == 1' does not hold"):
        compile_model(model_dir=str(tmp_path))


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# through the interpreter a whole model costs ~5 s a family: with --exhaustive (every template and
# attr is checked interpreted in the fast suite by tests/kernels/test_attention_mods.py)
@EXHAUSTIVE
@pytest.mark.parametrize("family", list(BUILDERS))
def test_through_kernels(family, vocab_model, tmp_path):
    """The fused build's kernels, interpreted: a 21-token prefill (chunks of 6 cross the 16-token
    page), a second sequence reusing the first's first page (a prefix hit) and computing only its
    tail, then two batched decodes; against the reference at bf16's tolerance."""
    d, _ = vocab_model(family)
    page = 16
    out = build(model_dir=str(d), out=tmp_path / "art", compile=False, log=None, page_size=page)
    plan = json.loads((out / "plan.json").read_text())
    plan["_dir"] = str(out)
    weights = load_weights(plan, Checkpoint(d))
    ref, run = ReferenceExecutor(plan, weights), InterpExecutor(plan, weights, page_size=page)
    rng = np.random.default_rng(3)
    a = [int(t) for t in rng.integers(0, VOCAB, 21)]
    b = a[:page] + [int(t) for t in rng.integers(0, VOCAB, 6)]
    tol = 2e-2
    got, want = run.step([Chunk(0, a, 0)]), ref.step([SeqChunk(0, a, 0)])
    assert _rel(got, want) < tol, ("prefill", _rel(got, want))
    run.ensure_pages(1, len(b), shared=run.pages[0][:1])
    ref.step([SeqChunk(1, b[:page], 0)])
    got, want = run.step([Chunk(1, b[page:], page)]), ref.step([SeqChunk(1, b[page:], page)])
    assert _rel(got, want) < tol, ("prefix-cached prefill", _rel(got, want))
    toks, lens = [int(np.argmax(want[0]))] * 2, [len(a), len(b)]
    for step in range(2):
        got = run.step([Chunk(0, [toks[0]], lens[0]), Chunk(1, [toks[1]], lens[1])])
        want = ref.step([SeqChunk(0, [toks[0]], lens[0]), SeqChunk(1, [toks[1]], lens[1])])
        assert _rel(got, want) < tol, (f"decode {step}", _rel(got, want))
        lens = [n + 1 for n in lens]
        toks = [int(t) for t in np.argmax(want, -1)]


@EXHAUSTIVE
def test_tensor_parallel(vocab_model):
    """The chunk and the temperature do not depend on the head: split over 2 ranks (simulated),
    Llama-4's logits are the single rank's and each rank's attention keeps them. (ALiBi's slopes
    follow the global head index: refused, below.)"""
    from infc.compiler.build import compile_ranks
    from infc.compiler.parallel import settings
    from infc.runtime.reference.ranks import RankExecutor
    d, _ = vocab_model("llama4")
    ranks = compile_ranks(settings(tensor_parallel_size=2), model_dir=str(d))
    plans = [p for _, p in ranks]
    many = RankExecutor(plans, [load_weights(p, Checkpoint(d)) for p in plans])
    one = ReferenceExecutor(*_plan_and_weights(d))
    assert np.abs(many.step([SeqChunk(0, PROMPT, 0)]) - one.step([SeqChunk(0, PROMPT, 0)])).max() <= TOL
    for _, plan in ranks:
        rep = next(r for r in plan["programs"]["prefill"] if "repeat" in r)
        att = [lc["attrs"] for body in rep["kinds"].values() for lc in body if lc["op"] == "attention_cached"]
        assert sorted((a["kv_heads"], a.get("chunk") or 0, a.get("temp_floor") or 0) for a in att) == [(1, 0, 4), (1, 6, 0)]


def test_alibi_refused_across_ranks(vocab_model):
    from infc.compiler.build import compile_ranks
    from infc.compiler.parallel import settings
    with pytest.raises(SpecError, match="tensor-parallel-size 2: ALiBi attention is not split across ranks"):
        compile_ranks(settings(tensor_parallel_size=2), model_dir=str(vocab_model("bloom")[0]))


def test_feature_backends_leave_the_mods_to_triton(vocab_model):
    """The TileLang decode implements none of the extra attrs: with --features tilelang, BLOOM's
    (ALiBi) and Llama-4's (chunk, temperature) decode attention stay on the Triton templates."""
    for family in ("bloom", "llama4"):
        _, plan = compile_model(model_dir=str(vocab_model(family)[0]), features=["tilelang"])
        rep = next(r for r in plan["programs"]["decode"] if "repeat" in r)
        got = {(lc["kernel"], lc["backend"]) for body in rep["kinds"].values() for lc in body
               if lc["op"] == "attention_cached"}
        assert got == {("attention_decode", "triton")}, family
