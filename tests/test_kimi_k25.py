"""Kimi-K2.5's text model (kimi_k25: Kimi_K25ForConditionalGeneration, Kimi-K2's DeepSeek-V3 text
model under a vision tower) bound by specs/deepseek_v2.yaml through its nested text_config, against
transformers' own model: a tiny random float32 checkpoint made by transformers, its text model
tests/test_deepseek_v3.py's Kimi-K2 form (q_lora, YaRN, the first layer dense, sigmoid routing
with a random e_score_correction_bias, routed_scaling_factor 2.827), untied lm_head as published,
saved in the published checkpoint's layout (language_model.model.layers.*, the text config's
model_type kimi_k2; HF loads it back to the same logits).

The reference executor gives HF's logits at every position of a 32-token prompt (4 blocks of 8)
within 1e-4 and the same 16 greedy tokens; the engine gives the same tokens and logprobs from one
shot, from chunked prefills and from a prefix-cache hit; the generated kernels under the
interpreter match the reference (fused in the fast suite; --no-fuse and a shared-page prefix with
--exhaustive). Configs the spec cannot serve fail naming why.
"""
import json
import shutil

import numpy as np
import pytest
import torch

from infc.compiler.build import compile_model
from infc.compiler.contract.errors import SpecError
from infc.compiler.contract.safetensors_io import Checkpoint
from infc.compiler.spec import SPECS_DIR, load_spec
from infc.runtime.weights.load import load_weights

from exhaustive import EXHAUSTIVE
from families import reference_greedy
from test_deepseek_v2 import BASE, VOCAB, assert_logits
from test_deepseek_v3 import VARIANTS, randomize_v3

PROMPT = [int(t) for t in np.random.default_rng(17).integers(0, VOCAB, 32)]
BLOCK = 8
VISION = dict(num_hidden_layers=1, hidden_size=16, intermediate_size=24, num_attention_heads=2,
              patch_size=4, pos_emb_height=4, pos_emb_width=4, pos_emb_time=2)


def _as_published(d):
    """HF's save_pretrained undoes its vision tower's `blocks -> layers` rename on every tensor
    (language_model.model.blocks.*) and keeps its own model.mm_projector prefix; the published
    checkpoint names them language_model.model.layers.* and mm_projector.*, and its text config
    says kimi_k2 (HF's config maps it to deepseek_v3 on load)."""
    from safetensors.torch import load_file, save_file
    for f in d.glob("*.safetensors"):
        t = load_file(str(f))
        renamed = {k.replace("language_model.model.blocks.", "language_model.model.layers.")
                    .replace("model.mm_projector.", "mm_projector."): v.contiguous() for k, v in t.items()}
        save_file(renamed, str(f), metadata={"format": "pt"})
    c = json.loads((d / "config.json").read_text())
    c["text_config"]["model_type"] = "kimi_k2"
    (d / "config.json").write_text(json.dumps(c, indent=2))
    idx = d / "model.safetensors.index.json"
    assert not idx.exists()           # one shard at these sizes: no index to rewrite


@pytest.fixture(scope="module")
def k25(tmp_path_factory):
    from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration
    torch.manual_seed(4325)
    cfg = Kimi_K25Config(text_config={**BASE, **VARIANTS["kimi"]}, vision_config=VISION,
                         projection_hidden_size=16, tie_word_embeddings=False)
    model = Kimi_K25ForConditionalGeneration(cfg).float().eval()
    model.set_attn_implementation("eager")
    randomize_v3(model, model.model.language_model.layers)
    d = tmp_path_factory.mktemp("kimi_k25")
    model.save_pretrained(d)
    _as_published(d)
    _, plan = compile_model(model_dir=str(d))
    return d, model, plan, load_weights(plan, Checkpoint(d))


def _hf_logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float().numpy()


def test_published_layout_loads_in_hf_as_the_model(k25):
    """The checkpoint the tests read is one HF reads as this model (not only HF's own save)."""
    from transformers import Kimi_K25ForConditionalGeneration
    d, hf, plan, _ = k25
    from safetensors import safe_open
    names = set(safe_open(str(next(d.glob("*.safetensors"))), "np").keys())
    assert "language_model.model.layers.1.mlp.gate.e_score_correction_bias" in names
    assert "language_model.lm_head.weight" in names and not any(".blocks." in n and "language" in n for n in names)
    again = Kimi_K25ForConditionalGeneration.from_pretrained(d, dtype=torch.float32).eval()
    again.set_attn_implementation("eager")
    assert np.abs(_hf_logits(again, PROMPT[:12]) - _hf_logits(hf, PROMPT[:12])).max() < 1e-6
    # the plan reads the text model's tensors under language_model. and the vision tower's none
    assert plan["weights"]["embed"]["source"] == {"tensor": "language_model.model.embed_tokens.weight"}
    assert plan["weights"]["lm_head"]["source"] == {"tensor": "language_model.lm_head.weight"}
    assert not any("vision" in json.dumps(w["source"]) for w in plan["weights"].values())


def test_logits_and_greedy_match_hf(k25):
    d, hf, plan, weights = k25
    routes = [n for n in json.dumps(plan["programs"]["prefill"]).split('"op": ') if n.startswith('"moe_route')]
    assert routes and all('"scoring": "sigmoid"' in n and '"has_bias": true' in n for n in routes)
    assert plan["config"]["rsf"] == 2.827 and plan["config"]["mtype"] == "kimi_k2"
    assert_logits(plan, weights, _hf_logits(hf, PROMPT), PROMPT)
    from transformers import GenerationConfig
    # no eos: min_new_tokens would mask the text config's eos id (1), this model's argmax at one step
    gen = GenerationConfig(max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=VOCAB - 1)
    with torch.no_grad():
        ids = torch.tensor([PROMPT])
        greedy = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             generation_config=gen)[0, len(PROMPT):].tolist()
    assert len(greedy) == 16 and reference_greedy(plan, weights, PROMPT, 16) == greedy


def _engine_run(plan, weights, prompts, **kw):
    """Each prompt's (tokens, per-token top-20 logprobs, cached prompt tokens), requests one after
    the other on one engine (a later one may hit an earlier one's blocks)."""
    from infc.runtime.engine.engine import Engine
    from infc.runtime.engine.runner import CPURunner
    from infc.runtime.engine.sampling import SamplingParams
    engine = Engine(CPURunner(plan, weights, 64, BLOCK), max_model_len=256, **kw)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=20)
    out = []
    for i, p in enumerate(prompts):
        engine.add_request(p, params, f"r{i}")
        toks, lps, cached = [], [], None
        while engine.has_unfinished():
            for o in engine.step():
                cached = o.num_cached_tokens if cached is None else cached
                toks += o.token_ids
                lps += [dict(lp["top"]) for lp in o.logprobs]
        out.append((toks, lps, cached))
    return out


def _same(a, b):
    assert a[0] == b[0]
    for x, y in zip(a[1], b[1]):
        assert x.keys() == y.keys() and max(abs(x[t] - y[t]) for t in x) <= 1e-5


def test_chunked_prefill_and_prefix_hit_equal_one_shot(k25):
    """The prompt's 4 blocks in one shot (no cache), in 7-token chunks, and a second prompt that
    shares 3 of the first's blocks (a prefix-cache hit): the same tokens and logprobs; the first
    token of one shot is HF's argmax."""
    d, hf, plan, weights = k25
    other = PROMPT[:3 * BLOCK] + PROMPT[:5]
    (one, one_b) = _engine_run(plan, weights, [PROMPT, other], enable_prefix_caching=False)
    assert one[2] == 0 and one_b[2] == 0 and one[0][0] == int(np.argmax(_hf_logits(hf, PROMPT)[-1]))
    (chunked,) = _engine_run(plan, weights, [PROMPT], enable_prefix_caching=False, max_num_batched_tokens=7)
    _same(chunked, one)
    first, hit = _engine_run(plan, weights, [PROMPT, other])
    assert first[2] == 0 and hit[2] == 3 * BLOCK
    _same(first, one)
    _same(hit, one_b)


def test_plan_is_kimi_k2s_reading_other_names(k25, tmp_path):
    """The K2.5 plan is the plan of its text config as a Kimi-K2 checkpoint (DeepseekV3ForCausalLM,
    the same keys at the top): the same programs, buffers and caches, every weight the same but
    for its tensor's name (language_model.model.* for model.*, language_model.lm_head for
    lm_head). So the kernels tests/test_deepseek_v3.py runs under the interpreter are these; the
    K2.5 checkpoint through them is the @EXHAUSTIVE test below (a minute on 2 cores)."""
    d, _, plan, _ = k25

    def flat(c):
        tie = c["tie_word_embeddings"]
        text = c.pop("text_config")
        c.clear()
        c.update(text, architectures=["DeepseekV3ForCausalLM"], tie_word_embeddings=tie)
    k2 = _compile_config(tmp_path, k25, flat)
    renamed = json.dumps(plan["weights"]).replace('"language_model.model.', '"model.').replace(
        '"language_model.lm_head.', '"lm_head.')
    assert json.loads(renamed) == k2["weights"] and renamed != json.dumps(plan["weights"])
    assert plan.keys() == k2.keys() and "programs" in plan
    for key in plan.keys() - {"weights", "config", "architectures", "model"}:
        assert plan[key] == k2[key], key
    assert {k: v for k, v in plan["config"].items() if k not in ("top", "k25", "prefix", "head_prefix")} == \
        {k: v for k, v in k2["config"].items() if k not in ("top", "k25", "prefix", "head_prefix")}


def _rel(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


@EXHAUSTIVE
@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "no-fuse"])
def test_through_kernels(k25, fuse, tmp_path):
    """test_deepseek_v2_interp's check (prefill, a narrow and a wide decode step), then a second
    sequence whose first KV page is the first's (a prefix hit) prefilling only its tail."""
    from infc.runtime.engine.step import Chunk
    from infc.runtime.reference.executor import SeqChunk
    from interp_protocol import PAGE, bf16_tolerance, executors
    from test_deepseek_v2_interp import check_through_kernels
    d, hf, _, _ = k25
    check_through_kernels(d, hf, tmp_path / "a", fuse=fuse)
    _, run, ref = executors(d, tmp_path / "art", fuse)
    a, b = PROMPT[:21], PROMPT[:PAGE] + PROMPT[24:30]
    tol = bf16_tolerance(hf)          # tests/test_families_interp.py's bound, a sequence's own
    assert _rel(run.step([Chunk(0, a, 0)]), ref.step([SeqChunk(0, a, 0)])) < tol(a)
    run.ensure_pages(1, len(b), shared=run.pages[0][:1])
    ref.step([SeqChunk(1, b[:PAGE], 0)])
    got, want = run.step([Chunk(1, b[PAGE:], PAGE)]), ref.step([SeqChunk(1, b[PAGE:], PAGE)])
    assert _rel(got, want) < tol(b), ("prefix-cached prefill", _rel(got, want))


def test_quantization_config_under_text_config_is_read(k25, tmp_path):
    """Kimi-K2.5 keeps its quantization_config in text_config (INT4 experts as published; FP8
    blocks here, tests/test_deepseek_v3.py's format): the plan reads the codes as it does from
    a top-level quantization_config, and the checkpoint check passes on the codes' tensors."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    from quantize_model import quantize_model
    top = tmp_path / "top"
    quantize_model(k25[0], top, "fp8-block", block=(8, 8), workers=1)
    nested = tmp_path / "nested"
    shutil.copytree(top, nested)
    c = json.loads((nested / "config.json").read_text())
    c["text_config"]["quantization_config"] = c.pop("quantization_config")
    (nested / "config.json").write_text(json.dumps(c))
    want = compile_model(model_dir=str(top))[1]
    got = compile_model(model_dir=str(nested))[1]
    assert got["weights"] == want["weights"]
    assert any(w.get("dtype") == "f8e4m3" and "language_model.model.layers" in json.dumps(w["source"])
               for w in got["weights"].values())


# -- configs the spec cannot serve --------------------------------------------------------------
def _compile_config(tmp_path, k25, edit):
    """The plan of the fixture's config.json changed by edit (no checkpoint read)."""
    d = tmp_path / "m"
    d.mkdir()
    c = json.loads((k25[0] / "config.json").read_text())
    edit(c)
    (d / "config.json").write_text(json.dumps(c))
    return compile_model(model_dir=str(d), check_checkpoint=False)[1]


def test_remote_code_architecture_name_binds(k25, tmp_path):
    """The published config.json names the checkpoint's own class, KimiK25ForConditionalGeneration."""
    plan = _compile_config(tmp_path, k25, lambda c: c.update(architectures=["KimiK25ForConditionalGeneration"]))
    assert plan["weights"]["lm_head"]["source"] == {"tensor": "language_model.lm_head.weight"}


@pytest.mark.parametrize("edit,match", [
    (lambda c: c.pop("text_config"),
     r"'hidden_size' \(symbol H\) is missing in .*config.json \(nor under text_config\)"),
    (lambda c: c["text_config"].update(model_type="qwen3"), r"requirement 'mtype in"),
    (lambda c: c["text_config"].update(rope_interleave=False), r"requirement 'rope_il'"),
    (lambda c: c.update(model_type="llava"), r"requirement 'top in"),
], ids=["no-text-config", "other-text-model", "rope-not-interleaved", "other-wrapper"])
def test_unservable_config_fails_naming_why(k25, tmp_path, edit, match):
    with pytest.raises(SpecError, match=match):
        _compile_config(tmp_path, k25, edit)


def test_top_level_keys_win_over_the_text_config():
    """nested_config: a key is read at config.json's top first (the wrapper's tie_word_embeddings,
    which HF's Kimi_K25ForConditionalGeneration ties by), then under text_config."""
    spec = load_spec(SPECS_DIR / "deepseek_v2.yaml")
    text = dict(spec.variants["kimi-k2"], model_type="kimi_k2", tie_word_embeddings=False)
    text.pop("quantization_config")
    env = spec.bind({"model_type": "kimi_k25", "architectures": ["Kimi_K25ForConditionalGeneration"],
                     "tie_word_embeddings": True, "text_config": text})
    assert env["tie"] is True and env["H"] == 7168 and env["prefix"] == "language_model.model."
    assert env["mtype"] == "kimi_k2" and env["top"] == "kimi_k25" and env["v3"]
    env = spec.bind(dict(text, tie_word_embeddings=True))     # Kimi-K2 itself: no nesting
    assert env["tie"] is True and env["prefix"] == "model." and env["head_prefix"] == ""
