"""MTP speculation (issue 43): the multi-token-prediction layer a checkpoint ships, declared in its
family's spec (`mtp:` in specs/deepseek_v2.yaml and specs/qwen3_5.yaml, compiled by
Spec.mtp_section) and run by the head proposer (runtime/engine/speculative/eagle.py) on the
target's last hidden state (compiler/passes/capture_hidden.py at layer L).

Tiny random float32 checkpoints made by transformers: the model with L + 1 layers, whose last
layer becomes the MTP layer's decoder block (DeepSeek-V3: model.layers.{L}.* with enorm, hnorm,
eh_proj, shared_head; Qwen3.5: mtp.layers.0.* with mtp.fc and its norms), its config.json saying
L layers and one MTP layer. HF defines no MTP module, so the reference is written here from the
weights' definition with HF's own modules for every part HF has (the decoder layer, its rotary
embedding, the RMSNorms): its drafts over every proposal the engine makes must be the engine's.
Then: greedy output identical to plain decoding (with a prefix hit and an abort mid-speculation),
every draft accepted by a construction that makes the MTP layer agree with its target, and the
errors: a checkpoint without MTP weights, a config that declares none. On the CUDA runner:
tests/test_spec_mtp_cuda.py.
"""
import json

import numpy as np
import pytest
import torch

from exhaustive import EXHAUSTIVE
from infc.runtime.engine.sampling import SamplingParams

V = 320
L = 2                                     # the target's layers; layer L is the MTP block


def _causal_mask(n):
    return torch.full((n, n), float("-inf")).triu(1)[None, None]


def _save(d, tensors: dict, config: dict):
    from safetensors.numpy import save_file
    for f in d.glob("*.safetensors"):
        f.unlink()
    (d / "model.safetensors.index.json").unlink(missing_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(d / "model.safetensors"),
              metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(config))


def _tensors(d) -> dict:
    from safetensors.numpy import load_file
    return load_file(str(d / "model.safetensors"))


# -- DeepSeek-V3 ----------------------------------------------------------------------------------
def make_deepseek(d, seed=0):
    """A DeepSeek-V3-shaped model (q_lora, MoE from layer 1: the MTP block is an MoE layer) with
    its MTP layer; returns the HF model of L + 1 layers (its layer L the MTP block)."""
    from test_deepseek_v2 import BASE
    from test_deepseek_v3 import VARIANTS, randomize_v3
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    torch.manual_seed(4400 + seed)
    cfg = DeepseekV3Config(**{**BASE, **VARIANTS["v3"], "num_hidden_layers": L + 1})
    full = DeepseekV3ForCausalLM(cfg).float().eval()
    full.set_attn_implementation("eager")
    randomize_v3(full, full.model.layers)
    full.save_pretrained(d)
    t, c = _tensors(d), json.loads((d / "config.json").read_text())
    rng = np.random.default_rng(seed)
    H = BASE["hidden_size"]
    p = f"model.layers.{L}."
    for n in ("enorm", "hnorm", "shared_head.norm"):
        t[p + n + ".weight"] = (1 + 0.3 * rng.standard_normal(H)).astype(np.float32)
    t[p + "eh_proj.weight"] = (0.15 * rng.standard_normal((H, 2 * H))).astype(np.float32)
    t[p + "embed_tokens.weight"] = t["model.embed_tokens.weight"]        # as published: copies
    t[p + "shared_head.head.weight"] = t["lm_head.weight"]
    _save(d, t, {**c, "num_hidden_layers": L, "num_nextn_predict_layers": 1})
    return full


class _Reference:
    """What both families' MTP references share: HF's decoder layers over full.model (self.m) with
    a causal mask, and the target's final-normed hidden states after its L layers."""
    def _layers(self, x, layers):
        n = x.shape[1]
        pos = torch.arange(n)[None]
        pe = self.m.rotary_emb(x, pos)
        for layer in layers:
            x = layer(x, attention_mask=_causal_mask(n), position_ids=pos, position_embeddings=pe)
        return x

    def target_hidden(self, toks):
        x = self._layers(self.m.embed_tokens(torch.tensor([toks])), self.m.layers[:L])
        return self.m.norm(x)[0]


class DeepseekReference(_Reference):
    """The MTP layer from its definition over HF's modules: h the target's final-normed last
    hidden state, x = eh_proj(concat(enorm(embed(t + 1)), hnorm(h))), HF's decoder layer L, then
    shared_head.norm and lm_head; chained rows feed the layer's output (before the norm)."""
    def __init__(self, full, d):
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm
        t, self.m = _tensors(d), full.model
        H, eps = full.config.hidden_size, full.config.rms_norm_eps
        p = f"model.layers.{L}."

        def norm(name):
            n = DeepseekV3RMSNorm(H, eps)
            n.weight.data = torch.from_numpy(t[p + name + ".weight"])
            return n
        self.enorm, self.hnorm, self.head_norm = norm("enorm"), norm("hnorm"), norm("shared_head.norm")
        self.eh_proj = torch.from_numpy(t[p + "eh_proj.weight"])
        self.lm_head = full.lm_head

    def mtp(self, ids, h):
        e = self.enorm(self.m.embed_tokens(torch.tensor([ids])))
        x = torch.cat([e, self.hnorm(h[None])], -1) @ self.eh_proj.T
        x = self._layers(x, [self.m.layers[L]])[0]
        return x, self.lm_head(self.head_norm(x))


# -- Qwen3.5 --------------------------------------------------------------------------------------
QWEN = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=512,
            initializer_range=0.08,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                             "mrope_section": [1, 1, 2], "mrope_interleaved": True})


def make_qwen(d, seed=0):
    """A Qwen3.5-shaped model of full-attention layers only (linear attention's recurrent state
    has no rollback: such targets are refused) with its MTP head (mtp.*); returns the HF model of
    L + 1 layers."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    torch.manual_seed(4500 + seed)
    full = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**QWEN, num_hidden_layers=L + 1, tie_word_embeddings=False,
                                                layer_types=["full_attention"] * (L + 1))).float().eval()
    full.set_attn_implementation("eager")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in full.named_parameters():
            if "norm" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))     # (1 + w) norms
    full.save_pretrained(d)
    t, c = _tensors(d), json.loads((d / "config.json").read_text())
    rng = np.random.default_rng(seed)
    H = QWEN["hidden_size"]
    for k in [k for k in t if k.startswith(f"model.layers.{L}.")]:
        t["mtp.layers.0." + k[len(f"model.layers.{L}."):]] = t.pop(k)
    for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        t[f"mtp.{n}.weight"] = (0.3 * rng.standard_normal(H)).astype(np.float32)
    t["mtp.fc.weight"] = (0.15 * rng.standard_normal((H, 2 * H))).astype(np.float32)
    _save(d, t, {**c, "num_hidden_layers": L, "layer_types": ["full_attention"] * L,
                 "mtp_num_hidden_layers": 1})
    return full


class QwenReference(_Reference):
    """Qwen3.5's MTP head from its definition over HF's modules: x = fc(concat(
    pre_fc_norm_embedding(embed(t + 1)), pre_fc_norm_hidden(h))), HF's decoder layer, mtp.norm,
    lm_head; chained rows feed the head's normed output."""
    def __init__(self, full, d):
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm
        t, self.m = _tensors(d), full.model
        H, eps = full.config.hidden_size, full.config.rms_norm_eps

        def norm(name):
            n = Qwen3_5RMSNorm(H, eps)
            n.weight.data = torch.from_numpy(t[f"mtp.{name}.weight"])
            return n
        self.e_norm, self.h_norm, self.norm = (norm(n) for n in ("pre_fc_norm_embedding",
                                                                 "pre_fc_norm_hidden", "norm"))
        self.fc = torch.from_numpy(t["mtp.fc.weight"])
        self.lm_head = full.lm_head

    def mtp(self, ids, h):
        e = self.e_norm(self.m.embed_tokens(torch.tensor([ids])))
        x = torch.cat([e, self.h_norm(h[None])], -1) @ self.fc.T
        x = self.norm(self._layers(x, [self.m.layers[L]]))[0]
        return x, self.lm_head(x)


FAMILIES = {"deepseek_v3": (make_deepseek, DeepseekReference, "deepseek_v2.yaml"),
            "qwen3_5": (make_qwen, QwenReference, "qwen3_5.yaml")}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """family -> (directory, HF model of L + 1 layers)."""
    out = {}
    for fam, (make, _, _) in FAMILIES.items():
        d = tmp_path_factory.mktemp(f"mtp-{fam}")
        out[fam] = (d, make(d))
    return out


def reference_drafts(ref, toks: list, k: int) -> tuple[list, np.ndarray]:
    """The MTP layer's k drafts after toks (the last one not yet in the target's KV): positions
    0..n-2 read the target's hidden states, each chained row its own row before; and the hidden
    state the last chained row outputs."""
    with torch.no_grad():
        h = ref.target_hidden(toks[:-1])
        ids, drafts = list(toks[1:]), []
        for _ in range(k):
            out, logits = ref.mtp(ids, h)
            drafts.append(int(torch.argmax(logits[-1])))
            ids.append(drafts[-1])
            h = torch.cat([h, out[-1:]])
    return drafts, out[-1].numpy()


def _engine(d, spec=None, **kw):
    """d's engine on the cpu (its spec named: no search through specs/)."""
    from infc.backend import load_backend
    from infc.compiler.spec import SPECS_DIR
    fam = next(f for f in FAMILIES if f"mtp-{f}" in str(d))
    kw = dict(device="cpu", max_num_seqs=16, log=None, num_gpu_blocks_override=64,
              spec=str(SPECS_DIR / FAMILIES[fam][2]), **kw)
    if spec:
        kw["speculative_config"] = spec
    e = load_backend(d, **kw).engine
    return getattr(e, "engine", e)


MTP = {"method": "mtp", "num_speculative_tokens": 3}


def _run(e, prompts, n=12, abort_at=None):
    got, steps = {}, 0
    for i, p in enumerate(prompts):
        e.add_request(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), f"r{i}")
    while e.has_unfinished():
        steps += 1
        if abort_at is not None and steps == abort_at[0]:
            e.abort(abort_at[1])
        for o in e.step():
            got.setdefault(o.request_id, []).extend(o.token_ids)
    return got, steps


PROMPTS = [[3, 17, 99, 5, 250, 8, 1, 3, 17, 99], [5, 6, 7, 8, 9]]


@pytest.mark.parametrize("fam", sorted(FAMILIES))
def test_drafts_equal_the_reference_and_greedy_is_plain(models, fam):
    """The proposals the engine's MTP proposer makes for the first request (a catch-up over the
    prompt, then one after each verification) are the reference's k drafts for the sequence's
    tokens at that moment, its last chained hidden state the reference's; the output is plain
    decoding's, the MTP layer's pages all come back, and the tensors it shares with the target
    are the target's arrays."""
    d, full = models[fam]
    ref = FAMILIES[fam][1](full, d)
    e = _engine(d, MTP)
    prop, seen = e.spec.draft, []
    propose = prop.propose

    def recording(wants, row_at=None):
        out = propose(wants, row_at)
        made = [s for s, _ in wants if s.seq_id in out]
        if len({len(out[s.seq_id]) for s in made}) == 1:      # the last forward: one row each
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
    mine, target = prop.runner.executor.weights, e.runner.executor.weights
    assert all(mine[k] is target[k] for k in ("embed", "lm_head", "final_norm"))   # not read twice


def _edited(d, out, change: dict, config: dict | None = None):
    """A copy of model directory d with tensors replaced (a value None drops the tensor; a
    callable name -> bool drops every match) and config.json keys replaced (None drops the key)."""
    import shutil
    shutil.copytree(d, out)
    t = _tensors(out)
    for k, v in change.items():
        if callable(v):
            t = {n: a for n, a in t.items() if not v(n)}
        elif v is None:
            t.pop(k)
        else:
            t[k] = np.broadcast_to(np.float32(v), t[k].shape).copy()
    c = json.loads((out / "config.json").read_text())
    for k, v in (config or {}).items():
        if v is None:
            c.pop(k, None)
        else:
            c[k] = v
    _save(out, t, c)
    return out


@pytest.mark.parametrize("fam", ["deepseek_v3", pytest.param("qwen3_5", marks=EXHAUSTIVE)])
def test_prefix_hit_and_abort_mid_speculation(models, fam):
    """A request whose prompt hits the prefix cache (the MTP layer has no target rows for the
    cached positions: it proposes nothing there, the sequence decodes as usual) and one aborted
    while it speculates: the others' output is plain decoding's; no page of the MTP layer's is
    left held, no shadow sequence left behind."""
    d, _ = models[fam]
    prompts = [PROMPTS[0] * 2, PROMPTS[0] * 2 + [7, 7], PROMPTS[1]]    # a page of 16 in common
    plain, _ = _run(_engine(d), prompts, n=8)
    e = _engine(d, MTP)
    first, _ = _run(e, prompts[:1], n=8)                     # r0 alone: its prompt in the cache
    assert first["r0"] == plain["r0"]
    drafts, hits = e.metrics.spec_decode_num_draft_tokens_total, e.metrics.prefix_cache_hits_total
    got = {}
    for i, p in enumerate(prompts[1:], 1):
        e.add_request(p, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), f"r{i}")
    for step in range(20):
        if not e.has_unfinished():
            break
        if step == 2:
            assert e.spec.draft.shadows                       # r2 is speculating
            assert e.abort("r2")
        for o in e.step():
            got.setdefault(o.request_id, []).extend(o.token_ids)
    assert got["r1"] == plain["r1"]
    assert e.metrics.prefix_cache_hits_total >= hits + 16
    assert len(got.get("r2", [])) < 8
    assert e.metrics.spec_decode_num_draft_tokens_total > drafts
    assert e.spec.draft.held_pages() == 0 and not e.spec.draft.shadows and not e.spec.draft.hiddens


@pytest.mark.parametrize("fam", ["qwen3_5", pytest.param("deepseek_v3", marks=EXHAUSTIVE)])
def test_constructed_mtp_accepts_every_draft(models, fam, tmp_path):
    """A target whose final norm is zero has zero logits (argmax 0 everywhere); an MTP layer whose
    last norm is zero proposes 0 too: every draft is accepted, k + 1 tokens a step (12 tokens:
    the prefill's, then 4 + 4 + 3)."""
    d, _ = models[fam]
    if fam == "qwen3_5":                                    # (1 + w) norms: w = -1 is zero
        zero = {"model.norm.weight": -1.0, "mtp.norm.weight": -1.0}
    else:
        zero = {"model.norm.weight": 0.0, f"model.layers.{L}.shared_head.norm.weight": 0.0}
    z = _edited(d, tmp_path / f"mtp-{fam}-zero", zero)
    e = _engine(z, MTP)
    got, steps = _run(e, PROMPTS, n=12)
    assert got == {"r0": [0] * 12, "r1": [0] * 12}
    mt = e.metrics
    assert mt.spec_decode_num_accepted_tokens_total == mt.spec_decode_num_draft_tokens_total == 2 * (3 + 3 + 2)
    assert steps == 4


def test_a_checkpoint_without_mtp_is_refused(models, tmp_path):
    """Refused at startup, naming what is missing: a config.json that declares no MTP layer, a
    checkpoint that declares one but lacks its weights, a family whose spec has none (what cuda
    still refuses: tests/test_spec_mtp_cuda.py)."""
    from infc.backend import load_backend
    from infc.config import speculative_config
    d, _ = models["deepseek_v3"]
    none = _edited(d, tmp_path / "mtp-deepseek_v3-none", {"x": lambda n: n.startswith(f"model.layers.{L}.")},
                   {"num_nextn_predict_layers": None})
    with pytest.raises(ValueError, match="this checkpoint has no MTP layer: num_nextn_predict_layers is 0"):
        _engine(none, MTP)
    lacking = _edited(d, tmp_path / "mtp-deepseek_v3-lacking", {"x": lambda n: ".eh_proj." in n})
    with pytest.raises(ValueError, match=f"tensor 'model.layers.{L}.eh_proj.weight' is missing"):
        _engine(lacking, MTP)
    from transformers import LlamaConfig, LlamaForCausalLM          # a family with no MTP layer
    LlamaForCausalLM(LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                 vocab_size=V, intermediate_size=48)).save_pretrained(tmp_path / "llama")
    with pytest.raises(ValueError, match="family 'llama' declares no MTP layer"):
        load_backend(tmp_path / "llama", device="cpu", log=None, speculative_config=MTP)
    assert speculative_config({"method": "deepseek_mtp", "num_speculative_tokens": 2}).method == "mtp"
    with pytest.raises(ValueError, match="method 'mtp' takes no 'model'"):
        speculative_config({"method": "mtp", "num_speculative_tokens": 2, "model": str(d)})


@pytest.mark.parametrize("old,new,message", [
    ('    names: ["{prefix}layers.{i}.", "{prefix}layers.{at}."]', '    names: "{prefix}layers.{at}."',
     r"'mtp.layer.names' must be \[from, to\]"),
    ("  count: n_mtp", "  count: n_mpt", "'mtp.count' must name the config symbol"),
    ("  target_ignore:", "  target_ignroe:", "unknown key 'target_ignroe' in 'mtp'; did you mean 'target_ignore'?"),
])
def test_mtp_section_errors_name_the_line(tmp_path, old, new, message):
    """A malformed `mtp:` section fails when the MTP plan is asked for, at its line."""
    from infc.compiler.contract.errors import SpecError
    from infc.compiler.spec import SPECS_DIR, load_spec
    text = (SPECS_DIR / "deepseek_v2.yaml").read_text()
    assert old in text
    bad = tmp_path / "deepseek_v2.yaml"
    bad.write_text(text.replace(old, new))
    line = text[:text.index(old)].count("\n") + 1
    with pytest.raises(SpecError, match=message) as e:
        load_spec(bad).mtp_section()
    assert e.value.line == line
