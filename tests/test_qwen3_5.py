"""Qwen3.5 (specs/qwen3_5.yaml, issue 12) against transformers, and the runtime's state slots.

Two tiny random checkpoints made by transformers itself: a Qwen3_5ForCausalLM directory (weights
under model.; layers lin, full, lin, lin from layer_types) and a Qwen3_5ForConditionalGeneration
directory (text weights under model.language_model., a vision tower the spec ignores, lm_head
tied to the embedding by the top-level tie_word_embeddings, and config.json rewritten to give
full_attention_interval 2 instead of layer_types: lin, full, lin, full). Every norm, dt_bias and
A_log is random and non-zero; A_log is drawn so that the decays exp(g) stay mostly above 0.1, so
the recurrent state carries the prompt from step to step (a state dropped or read from the wrong
slot moves the logits).

The reference executor (float32) must give transformers' (float32) logits at every position of
a 40-token prompt within 1e-4 (as 40 prefixes in one step, and one token per step), the same 16
greedy tokens as generate(), the same logits from a chunked prefill (chunks of 7 and 16) as from
one shot, and two sequences of different lengths batched the same logits as each alone.

The runtime: a sequence holds a state slot from admission to finish / abort / preemption (block
manager, scheduler, 1,000 random aborts through the engine on the CPU runner with preemptions), a
plan with slot caches gets prefix-cache hits only with state snapshots (without a pool the engine
turns prefix caching off and says so once; tests/test_hybrid_prefix.py tests the hits), the CUDA
runner pads a step's state_slots
with the spare slot, and plans without slot caches carry no state_slots metadata.
"""
import json
import subprocess
import sys
import types

import numpy as np
import pytest
import torch

from infc.compiler.build import build, compile_model
from infc.compiler.contract import caches
from infc.runtime.engine.block_manager import BlockManager
from infc.runtime.engine.engine import Engine
from infc.compiler.contract.program import launches as _launches
from infc.runtime.reference.executor import ReferenceExecutor, SeqChunk
from infc.runtime.engine.runner import CPURunner, sample_row
from infc.runtime.engine.sampling import SamplingParams
from infc.runtime.engine.scheduler import Scheduler
from infc.runtime.engine.sequence import Sequence
from infc.runtime.engine.step import Chunk, build_step

from families import hf_logits, plan_and_weights, reference_greedy

VOCAB = 320
TOL = 1e-4
PROMPT = [int(t) for t in np.random.default_rng(11).integers(0, VOCAB, 40)]
TEXT = dict(vocab_size=VOCAB, hidden_size=96, intermediate_size=160, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=24, linear_conv_kernel_dim=4, max_position_embeddings=256,
            initializer_range=0.05,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                             "mrope_section": [1, 1, 2], "mrope_interleaved": True})


def _randomize(model):
    """(1 + w) norms: small random w; the gated norm's plain w: near 1; dt_bias random; A_log =
    log(A) with A in [0.05, 1.5] (decays that keep the state)."""
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


def _causal(**over):
    """over: TEXT's fields replaced (the server suite's model: vocab_size of its real tokenizer)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    return Qwen3_5ForCausalLM(Qwen3_5TextConfig(
        **{**TEXT, **over}, tie_word_embeddings=False,
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"]))


def _conditional():
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=96,
                  patch_size=4, temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)
    return Qwen3_5ForConditionalGeneration(Qwen3_5Config(
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
        d = tmp_path_factory.mktemp(f"qwen3_5-{kind}")
        model.save_pretrained(d)
        if kind == "conditional":      # the kinds from full_attention_interval, not layer_types
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
    top-level flag, layer kinds from layer_types or full_attention_interval."""
    for kind, (d, hf) in models.items():
        plan, _ = plan_and_weights(d)
        repeat = next(e for e in plan["programs"]["decode"] if "repeat" in e)
        assert repeat["schedule"] == _layer_types(hf), kind
        prefix = "model.language_model." if kind == "conditional" else "model."
        assert plan["weights"]["embed"]["source"] == {"tensor": prefix + "embed_tokens.weight"}
        assert ("tied" in plan["weights"]["lm_head"]["source"]) == (kind == "conditional")
    assert _layer_types(models["conditional"][1]) == ["linear_attention", "full_attention"] * 2


def test_vision_tower_is_ignored_on_purpose(models, tmp_path):
    """The checkpoint check reads every tensor: the vision tower passes only through the spec's
    `ignore:` entry."""
    from pathlib import Path

    from infc.compiler.contract.errors import SpecError
    spec = (Path(__file__).resolve().parent.parent / "specs" / "qwen3_5.yaml").read_text()
    cut = spec.replace('  - "model.visual.*"\n', "")
    assert cut != spec
    (tmp_path / "qwen3_5.yaml").write_text(cut)
    with pytest.raises(SpecError, match=r"model\.visual\."):
        compile_model(model_dir=str(models["conditional"][0]), spec_path=str(tmp_path / "qwen3_5.yaml"))


def test_plan_declares_slot_caches_and_state_slots(models):
    plan, _ = plan_and_weights(models["causal"][0])
    c = plan["caches"]
    assert c["conv"]["kind"] == c["recurrent"]["kind"] == "slot"
    assert c["conv"]["layers"] == c["recurrent"]["layers"] == [0, 2, 3]
    assert c["k"]["kind"] == "paged" and c["k"]["layers"] == [1]
    assert caches.storage_shape(c["recurrent"], 16, 1, 4) == (5, 4, 16, 24)
    assert caches.storage_shape(c["conv"], 16, 1, 4) == (5, 3, 2 * 32 + 96)
    assert "state_slots" in plan["step_metadata"]
    _, plain = compile_model("qwen3-0.6b")                 # no slot cache: metadata unchanged
    assert "state_slots" not in plain["step_metadata"]


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


@pytest.mark.parametrize("kind", ["causal", "conditional"])
def test_greedy_16_tokens_match_hf(models, kind):
    d, hf = models[kind]
    with torch.no_grad():
        want = hf.generate(input_ids=torch.tensor([PROMPT]), max_new_tokens=16, min_new_tokens=16,
                           do_sample=False, pad_token_id=0)[0, len(PROMPT):].tolist()
    plan, weights = plan_and_weights(d)
    assert reference_greedy(plan, weights, PROMPT, 16) == want


@pytest.mark.parametrize("chunk", [7, 16])
def test_chunked_prefill_equals_one_shot(models, chunk):
    d, hf = models["causal"]
    want = hf_logits(hf, PROMPT)
    plan, weights = plan_and_weights(d)
    one = ReferenceExecutor(plan, weights).step([SeqChunk(0, PROMPT, 0)])[0]
    ex = ReferenceExecutor(plan, weights)
    for start in range(0, len(PROMPT), chunk):
        end = min(start + chunk, len(PROMPT))
        got = ex.step([SeqChunk(0, PROMPT[start:end], start)])[0]
        assert np.abs(got - want[end - 1]).max() <= TOL, (start, end)
    assert np.abs(got - one).max() <= 1e-5


def test_batched_sequences_equal_each_alone(models):
    """A 40-token and a 23-token prompt in one prefill step, then 4 decode steps together, and
    a mixed step (one decodes while the other prefills its second chunk)."""
    plan, weights = plan_and_weights(models["causal"][0])
    a, b = PROMPT, PROMPT[::-1][:23]
    steps = [[SeqChunk(0, a, 0), SeqChunk(1, b, 0)]]
    toks = [[5, 17, 250, 3], [9, 9, 100, 41]]
    for i in range(4):
        steps.append([SeqChunk(0, [toks[0][i]], len(a) + i), SeqChunk(1, [toks[1][i]], len(b) + i)])
    together = ReferenceExecutor(plan, weights)
    got = [together.step(s) for s in steps]
    for row in (0, 1):
        alone = ReferenceExecutor(plan, weights)
        for s, g in zip(steps, got):
            assert np.abs(alone.step([s[row]])[0] - g[row]).max() <= 1e-5
    # mixed: sequence 2 decodes while sequence 3 prefills its second chunk
    mixed = ReferenceExecutor(plan, weights)
    mixed.step([SeqChunk(2, b, 0), SeqChunk(3, a[:9], 0)])
    m = mixed.step([SeqChunk(2, [7], len(b)), SeqChunk(3, a[9:], 9)])
    alone = ReferenceExecutor(plan, weights)
    assert np.abs(alone.step([SeqChunk(0, a, 0)])[0] - m[1]).max() <= 1e-5
    alone = ReferenceExecutor(plan, weights)
    alone.step([SeqChunk(0, b, 0)])
    assert np.abs(alone.step([SeqChunk(0, [7], len(b))])[0] - m[0]).max() <= 1e-5


def test_build_variant_no_compile(tmp_path):
    """`infc build --model qwen3.5-4b --no-compile` (the published shapes: 24 linear-attention
    and 8 full-attention layers)."""
    r = subprocess.run([sys.executable, "-m", "infc.cli", "build", "--model", "qwen3.5-4b",
                        "--no-compile", "--out", str(tmp_path / "a")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    plan = json.loads((tmp_path / "a" / "plan.json").read_text())
    repeat = next(e for e in plan["programs"]["decode"] if "repeat" in e)
    assert repeat["schedule"].count("full_attention") == 8
    assert repeat["schedule"][3::4] == ["full_attention"] * 8
    slot = caches.select(plan["caches"], ["recurrent", "conv"], layers=[0])   # per-sequence state
    assert caches.storage_shape(slot["recurrent"], 16, 1, 2) == (3, 32, 128, 128)
    assert caches.storage_shape(slot["conv"], 16, 1, 2) == (3, 3, 2 * 16 * 128 + 32 * 128)
    assert plan["weights"]["wq_wk_wv_wgate"]["shape"][0] == 2 * 16 * 256 + 2 * 4 * 256
    # as HF: g = -exp(A_log) * softplus(a + dt_bias) entirely in f32 (f32 weights, f32 promotion),
    # q and k l2-normalized into f32, beta = sigmoid(b) rounded to bf16; the f32 weights' fill kernel
    assert plan["weights"]["A"]["dtype"] == plan["weights"]["dt_bias"]["dtype"] == "f32"
    assert plan["weight_init_f32"] and plan["weight_init_f32"] != plan["weight_init"]
    # ... made inside the delta rule (compiler/passes/fuse_delta_rule.py): it reads the raw q, k (bf16
    # views of the conv's output) and a, b (of the fused projection), dt_bias and A, normalizes q and
    # k in f32 and rounds beta to bf16 itself
    for phase in ("decode", "prefill", "narrow"):
        rule = next(ln for ln, _ in _launches(plan["programs"][phase]) if ln["op"] == "gated_delta_rule")
        q, k, _, a, b = (plan["buffers"][n]["dtype"] for n in rule["inputs"][:5])
        assert (q, k, a, b) == ("bf16",) * 4 and rule["inputs"][5:7] == ["dt_bias", "A"]
        assert rule["attrs"]["gates"] == "bf16" and rule["attrs"]["qk_norm"] == 1e-6
        # ... and in two launches where it runs chunked (compiler/passes/split_delta_rule.py): the
        # chunks' W, U made first from the same inputs; the decode programs' kernel reads neither
        wy = [ln for ln, _ in _launches(plan["programs"][phase]) if ln["op"] == "delta_rule_wy"]
        if phase == "prefill":
            assert len(wy) == 1 and wy[0]["inputs"] == rule["inputs"][1:7] and rule["inputs"][7:] == wy[0]["outputs"]
            assert rule["attrs"]["chunk"] == wy[0]["attrs"]["chunk"] == 32
        else:
            assert not wy
        assert not [ln["op"] for ln, _ in _launches(plan["programs"][phase])
                    if ln["op"] in ("softplus", "sigmoid", "add", "mul", "copy", "l2_norm")
                    and ln.get("line") == rule.get("line")]
    r = subprocess.run([sys.executable, "-m", "infc.cli", "build", "--model", "qwen3.5-4b", "--no-fuse",
                        "--no-compile", "--out", str(tmp_path / "b")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    plain = json.loads((tmp_path / "b" / "plan.json").read_text())
    rule = next(ln for ln, _ in _launches(plain["programs"]["decode"]) if ln["op"] == "gated_delta_rule")
    q, k, _, g, beta = (plain["buffers"][n]["dtype"] for n in rule["inputs"])
    assert (q, k, g, beta) == ("f32", "f32", "f32", "bf16")
    chain = [ln for ln, _ in _launches(plain["programs"]["decode"])
             if "dt_bias" in ln["inputs"] or ln["op"] == "softplus"]
    assert [ln["op"] for ln in chain] == ["add", "softplus"]
    assert all(plain["buffers"][ln["outputs"][0]]["dtype"] == "f32" for ln in chain)


@pytest.mark.parametrize("off,fewer", [(("fuse_delta_gates",), 5), (("fuse_delta_norms",), 2),
                                       (("fuse_delta_gates", "fuse_delta_norms"), 7)])
def test_inputs_made_in_the_delta_rule_change_no_logit(models, monkeypatch, off, fewer):
    """fuse_delta_gates (the sigmoid, add, softplus and mul in the delta rule's launch) and
    fuse_delta_norms (q and k's l2 norms there too): the reference gives the same logits, bit for
    bit, as the same build without them, in prefill and decode; 5 (the sigmoid, the add, the
    softplus, the mul, and the copy the add needs) and 2 launches fewer in a linear-attention layer."""
    from infc.compiler import pipeline
    d = models["causal"][0]
    fused = plan_and_weights(d)
    monkeypatch.setattr(pipeline, "PIPELINE", [p for p in pipeline.PIPELINE if p[0] not in off])
    _, plan = compile_model(model_dir=str(d))
    plain = (plan, fused[1])
    counts = []
    for p, w in (fused, plain):
        counts.append(sum(1 for _ in _launches(p["programs"]["decode"])))
        ex = ReferenceExecutor(p, w)
        got = [ex.step([SeqChunk(0, PROMPT[:30], 0)])[0]]
        got += [ex.step([SeqChunk(0, [t], 30 + i)])[0] for i, t in enumerate(PROMPT[30:36])]
        counts[-1] = (counts[-1], np.stack(got))
    (n_fused, a), (n_plain, b) = counts
    assert np.array_equal(a, b)
    assert n_plain - n_fused == fewer                    # in the linear-attention layers' body


def test_dummy_weights_keep_the_state_decaying(models):
    """--load-format dummy: A = -exp(A_log) is filled near -1 (near +1, as a norm scale, the
    decays exp(g) would exceed 1 and the recurrent state would grow without bound)."""
    from infc.runtime.weights.dummy import dummy_weights, rule
    plan, _ = plan_and_weights(models["causal"][0])
    assert rule(plan["weights"]["A"])[1] == -1.0 and rule(plan["weights"]["o_norm"])[1] == 1.0
    w = dummy_weights(plan)
    assert all((a < 0).all() for a in w["A"])
    ex = ReferenceExecutor(plan, w)
    logits = ex.step([SeqChunk(0, PROMPT, 0)])
    for p in range(40, 60):
        logits = ex.step([SeqChunk(0, [int(np.argmax(logits[0]))], p)])
    assert np.isfinite(logits).all()


# -- state slots in the runtime -----------------------------------------------------------------

def _seq(i, n=6):
    return Sequence(i, f"r{i}", 0, list(range(1, n + 1)), SamplingParams(max_tokens=4), seed=i)


def test_block_manager_gives_and_takes_back_slots():
    bm = BlockManager(num_pages=16, page_size=4, num_slots=2)
    s = [_seq(i) for i in range(3)]
    assert bm.admit(s[0], 64) == 6 and bm.admit(s[1], 64) == 6
    assert {s[0].slot, s[1].slot} == {0, 1} and bm.num_free_slots == 0
    assert bm.admit(s[2], 64) == 0 and s[2].slot is None and not s[2].pages   # pages free, no slot
    bm.release(s[0])
    assert s[0].slot is None and bm.num_free_slots == 1
    assert bm.admit(s[2], 64) == 6 and s[2].slot is not None
    bm.check()
    bm0 = BlockManager(num_pages=16, page_size=4)          # a plan without slot caches
    assert bm0.admit(s[0], 64) == 6 and s[0].slot is None


def test_scheduler_preemption_and_finish_release_slots():
    bm = BlockManager(num_pages=4, page_size=4, num_slots=3)
    sch = Scheduler(bm, max_num_seqs=3, max_num_batched_tokens=64)
    seqs = [_seq(i, 5) for i in range(3)]
    for s in seqs:
        sch.add(s)
    sch.schedule()                                   # two fit (2 pages each), the third waits
    assert [s.slot is not None for s in seqs] == [True, True, False]
    for s in seqs[:2]:
        s.num_computed_tokens = 5
        s.token_ids += [7, 7, 7, 7]                      # each needs a third page now
    sch.schedule()                                   # the newest running one is preempted
    assert sch.num_preemptions >= 1
    victim = next(s for s in seqs[:2] if s.slot is None)
    assert victim.num_computed_tokens == 0 and not victim.pages       # recomputed from token 0
    for s in list(sch.running) + list(sch.waiting):
        sch.finish(s, "abort")
    assert bm.num_free_slots == 3 and bm.num_free_pages == 4
    bm.check()


def test_build_step_state_slots():
    meta = build_step([Chunk(7, [1, 2], 0), Chunk(9, [3], 4)], {7: [0], 9: [1]}.__getitem__, 16,
                      slot_of={7: 5, 9: 2}.__getitem__)
    assert meta.state_slots.tolist() == [5, 2] and meta.state_slots.dtype == np.int32
    plain = build_step([Chunk(7, [1, 2], 0)], {7: [0]}.__getitem__, 16)
    assert plain.state_slots.tolist() == [0]


class _Capture(CPURunner):
    """The CPU runner, keeping each step's logits."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.seen = []

    def execute(self, meta, sampling):
        logits = self.executor.step_paged(meta)
        self.seen.append(logits.copy())
        return [None if s is None else sample_row(logits[b], s) for b, s in enumerate(sampling)]


def test_engine_prefix_caching_over_slot_caches_needs_snapshots(models):
    """Without a snapshot pool (num_state_snapshots=0) the engine turns prefix caching off, says
    so once, and a repeated prompt is computed again with the same logits; with one, the repeat
    hits up to the prompt's last block boundary (tests/test_hybrid_prefix.py checks the logits)."""
    plan, weights = plan_and_weights(models["causal"][0])
    lines = []
    runner = _Capture(plan, weights, num_pages=32, page_size=4, max_num_seqs=4, num_state_snapshots=0)
    assert runner.num_slots == 4
    e = Engine(runner, max_model_len=128, max_num_seqs=4, enable_prefix_caching=True, log=lines.append)
    assert [line for line in lines if "prefix caching disabled" in line] == lines and len(lines) == 1
    assert not e.bm.enable_prefix_caching and e.snapshots is None
    firsts, outs = [], []
    for _ in range(2):                              # the same prompt twice, one after the other
        e.add_request(PROMPT, SamplingParams(max_tokens=3, temperature=0))
        n = len(runner.seen)
        while e.has_unfinished():
            outs += e.step()
        firsts.append(runner.seen[n])
    assert e.bm.hit_tokens == 0 and all(o.num_cached_tokens == 0 for o in outs)
    assert np.array_equal(firsts[0], firsts[1])
    want = hf_logits(models["causal"][1], PROMPT)[-1]
    assert np.abs(firsts[0][0] - want).max() <= TOL
    lines.clear()
    e = Engine(_Capture(plan, weights, num_pages=32, page_size=4, max_num_seqs=4), max_model_len=128,
               max_num_seqs=4, log=lines.append)
    assert e.bm.enable_prefix_caching and any("state snapshots" in line for line in lines)
    for _ in range(2):
        e.add_request(PROMPT, SamplingParams(max_tokens=3, temperature=0))
        while e.has_unfinished():
            e.step()
    assert e.bm.hit_tokens == 36 and np.abs(e.runner.seen[-3][0] - want).max() <= TOL
    # a plan without slot caches keeps prefix caching, and no line is logged
    _, plain = compile_model("qwen3-0.6b")
    stub = types.SimpleNamespace(page_size=4, num_pages=8, plan=plain)
    quiet = []
    assert Engine(stub, max_model_len=64, log=quiet.append).bm.enable_prefix_caching and not quiet


def test_cpu_backend_sizes_slots_by_max_num_seqs(models):
    """What `infc serve --device cpu --max-num-seqs 3` builds: 3 state slots and 3 snapshots,
    the pages budget net of them, the snapshots' memory in one startup line."""
    from infc.backend import load_backend
    lines = []
    b = load_backend(models["conditional"][0], device="cpu", max_num_seqs=3, asynchronous=False,
                     log=lines.append, kv_cache_memory_bytes=1 << 22)
    e = b.engine
    assert e.runner.num_slots == 3 and e.bm.num_free_slots == 3 and e.bm.enable_prefix_caching
    assert e.snapshots.num == 3 and sum("state snapshots" in line for line in lines) == 1
    plan = e.runner.plan
    assert e.runner.num_pages == CPURunner.pages_for_budget(plan, e.page_size, 1 << 22, 6) < \
        CPURunner.pages_for_budget(plan, e.page_size, 1 << 22, 3)
    e.add_request(PROMPT[:10], SamplingParams(max_tokens=2, temperature=0))
    while e.has_unfinished():
        e.step()
    assert e.bm.num_free_slots == 3
    off = load_backend(models["conditional"][0], device="cpu", max_num_seqs=3, asynchronous=False,
                       kv_cache_memory_bytes=1 << 22, enable_prefix_caching=False).engine
    assert off.snapshots is None and off.runner.num_snapshots == 0


class OverlappedCPURunner(CPURunner):
    """The CPU runner under overlapped engine steps (each step's tokens read one step late), as the
    CUDA runner runs them: the slot caches' bookkeeping must hold either way."""
    can_overlap = True


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_engine_random_aborts_and_preemptions_free_every_slot(models, overlap):
    """1,000 aborts at random moments (issue 12's count) (waiting, mid-prefill, mid-decode) among requests that also
    finish and get preempted (few pages): afterwards every slot and page is free again, and the
    survivors' slots were never shared."""
    plan, weights = plan_and_weights(models["causal"][0])
    runner = (OverlappedCPURunner if overlap else CPURunner)(plan, weights, num_pages=10, page_size=4, max_num_seqs=4)
    e = Engine(runner, max_model_len=40, max_num_seqs=4, max_num_batched_tokens=24)
    assert e.overlap == overlap
    rng = np.random.default_rng(0)
    live, aborted, submitted = [], 0, 0
    while aborted < 1000:
        for _ in range(int(rng.integers(1, 4))):
            rid = e.add_request([int(t) for t in rng.integers(0, VOCAB, int(rng.integers(2, 12)))],
                                SamplingParams(max_tokens=int(rng.integers(1, 10)), temperature=0))
            live.append(rid)
            submitted += 1
        for o in e.step():
            if o.request_finished:
                live.remove(o.request_id)
        running = [s for s in e.scheduler.running]
        slots = [s.slot for s in running]
        assert None not in slots and len(set(slots)) == len(slots)
        assert all(s.slot is None for s in e.scheduler.waiting)
        assert e.bm.num_free_slots + len(running) == runner.num_slots
        for rid in list(live):
            if rng.random() < 0.3:
                assert e.abort(rid)
                live.remove(rid)
                aborted += 1
    while e.has_unfinished():
        e.step()
    assert e.scheduler.num_preemptions > 0
    assert e.bm.num_free_slots == runner.num_slots == 4
    assert e.bm.num_free_pages == runner.num_pages
    e.bm.check()                                 # the snapshots: none pinned, every one free or kept
    assert not e.snapshots.restores and all(b.ref == 0 for b in e.snapshots.blocks)




@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_engine_outputs_through_preemption_match_each_alone(models, overlap):
    """Four requests on 8 pages of 4 tokens: they preempt each other (recomputed from their last
    snapshot still cached, else from token 0), chunked prefills share steps with decodes, and each one's greedy tokens are
    still the ones it gets alone."""
    plan, weights = plan_and_weights(models["causal"][0])
    runner = (OverlappedCPURunner if overlap else CPURunner)(plan, weights, num_pages=8, page_size=4, max_num_seqs=4)
    e = Engine(runner, max_model_len=32, max_num_seqs=4, max_num_batched_tokens=12)
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(0, VOCAB, n)] for n in (10, 7, 12, 5)]
    ids = [e.add_request(p, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)) for p in prompts]
    got = {i: [] for i in ids}
    while e.has_unfinished():
        for o in e.step():
            got[o.request_id] += o.token_ids
    assert e.scheduler.num_preemptions > 0
    for rid, p in zip(ids, prompts):
        assert got[rid] == reference_greedy(plan, weights, p, 8), rid
    assert e.bm.num_free_slots == 4


# -- the CUDA runner's metadata (no GPU: tests/fake_cuda.py's driver) ----------------------------

def test_cuda_runner_pads_state_slots_with_the_spare_slot(fake_driver, models):
    from infc.runtime.cuda import runner as runner_mod
    plan, _ = plan_and_weights(models["causal"][0])
    assert "state_slots" in runner_mod.PRODUCED
    r = object.__new__(runner_mod.CudaRunner)
    r.plan, r.page_size, r.num_pages, r.max_pages_per_seq, r.max_seqs = plan, 16, 64, 8, 8
    r.meta = {n: 0 for n in plan["step_metadata"]}
    r.num_slots = 8
    from infc.runtime.cuda.plan_io import step_inputs
    r.inputs = step_inputs(plan)
    meta = build_step([Chunk(3, [1], 5), Chunk(4, [2], 9)], {3: [0], 4: [1]}.__getitem__, 16,
                      slot_of={3: 6, 4: 1}.__getitem__)
    arrays = r._metadata(meta, 4, 4)                 # a decode bucket of 4: two pad rows
    assert arrays["state_slots"].tolist() == [6, 1, 8, 8]
    assert arrays["context_lens"][2:].tolist() == [1, 1]   # pad rows have nothing cached: no read
    r.meta.pop("state_slots")                           # a plan without it gets none
    assert "state_slots" not in r._metadata(meta, 2, 2)
    assert caches.has_slots(plan["caches"]) and r.num_slots == 8


def test_fuse_delta_rule_off_builds_the_chain(models, monkeypatch):
    """infc/config.py FUSE_DELTA_RULE = False (the A/B's other side): the gates' and norms' launches
    are back, and the delta rule takes g and beta made."""
    import infc.config
    monkeypatch.setattr(infc.config, "FUSE_DELTA_RULE", False)
    _, plan = compile_model(model_dir=str(models["causal"][0]))
    ops = [ln["op"] for ln, _ in _launches(plan["programs"]["decode"])]
    assert {"l2_norm", "softplus", "sigmoid"} <= set(ops)
    rule = next(ln for ln, _ in _launches(plan["programs"]["decode"]) if ln["op"] == "gated_delta_rule")
    assert "gates" not in rule["attrs"] and "qk_norm" not in rule["attrs"]
    assert len(rule["inputs"]) == 5 + 2 and rule["inputs"][5].startswith("wy_w")    # W, U (split_delta_rule)


def test_the_executor_skips_the_delta_rules_wy_launch(models, monkeypatch):
    """delta_rule_wy's outputs are read only by kernels (OpDef.unread): the reference executor's
    prefill runs no reference of it (the rule's own recomputes what W and U hold), and the logits
    are those of the plan without the split."""
    import infc.config
    from infc.compiler.ops import REGISTRY

    def refused(*a, **kw):
        raise AssertionError("delta_rule_wy's reference ran in a step")
    d = models["causal"][0]
    plan, weights = plan_and_weights(d)
    assert any(ln["op"] == "delta_rule_wy" for ln, _ in _launches(plan["programs"]["prefill"]))
    monkeypatch.setattr(REGISTRY["delta_rule_wy"], "reference", refused)
    got = ReferenceExecutor(plan, weights).step([SeqChunk(0, PROMPT[:30], 0)])[0]
    monkeypatch.setattr(infc.config, "DELTA_WY", False)
    _, one = compile_model(model_dir=str(d))
    assert np.array_equal(got, ReferenceExecutor(one, weights).step([SeqChunk(0, PROMPT[:30], 0)])[0])
