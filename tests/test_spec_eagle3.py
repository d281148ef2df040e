"""EAGLE-3 speculation (issue 43): the target's hidden states as a plan output
(compiler/passes/capture_hidden.py) equal to HF's at the layers asked; the head (specs/eagle3.yaml)
run by the proposer (runtime/engine/speculative/eagle.py) equal to a numpy EAGLE-3 written here
from its definition, over a catch-up, a chain of k steps and a rollback; the engine's greedy
output with a random head identical to plain decoding; a head constructed to agree with its
target accepting every draft."""
import json

import numpy as np
import pytest

from exhaustive import EXHAUSTIVE
from infc.runtime.engine.sampling import SamplingParams
from make_eagle3_head import write_head

H, L, V, VD = 64, 4, 300, 120


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A tiny Llama written by transformers (plain RoPE), norms randomized; (dir, HF model)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(7)
    m = LlamaForCausalLM(LlamaConfig(hidden_size=H, num_hidden_layers=L, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=V, intermediate_size=96,
                                     max_position_embeddings=256, rms_norm_eps=1e-6)).float().eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
    d = tmp_path_factory.mktemp("eagle-target")
    m.save_pretrained(d)
    return d, m


@pytest.mark.parametrize("fuse", [True, pytest.param(False, marks=EXHAUSTIVE)])
def test_captured_hidden_states_are_hf_layer_inputs(target, fuse):
    """aux_hidden's columns: the residual entering layers 0 (the embeddings) and 2, and the last
    layer's output before the final norm (index L), fused and --no-fuse."""
    import torch
    from infc.compiler.build import compile_model
    from infc.compiler.contract.safetensors_io import Checkpoint
    from infc.runtime.engine.step import Chunk
    from infc.runtime.reference.executor import ReferenceExecutor
    from infc.runtime.weights.load import load_weights
    d, m = target
    toks = [3, 17, 99, 5, 250, 8, 1]
    with torch.no_grad():
        hs = [h[0].numpy() for h in m(torch.tensor([toks]), output_hidden_states=True).hidden_states]
    w = m.model.norm.weight.detach().numpy()
    _, plan = compile_model(model_dir=str(d), capture=[L, 0, 2], fuse=fuse)
    ex = ReferenceExecutor(plan, load_weights(plan, Checkpoint(d)))
    ex.step([Chunk(0, toks, 0)])
    aux = ex.outputs["aux_hidden"]
    assert aux.shape == (len(toks), 3 * H)
    last = aux[:, :H]
    normed = last / np.sqrt((last * last).mean(-1, keepdims=True) + 1e-6) * w
    np.testing.assert_allclose(normed, hs[L], atol=2e-5)    # HF's last entry is after the norm
    np.testing.assert_allclose(aux[:, H:2 * H], hs[0], atol=1e-6)
    np.testing.assert_allclose(aux[:, 2 * H:], hs[2], atol=2e-5)


@EXHAUSTIVE
def test_captured_hidden_states_through_the_kernels(target, tmp_path):
    """The captured plan through its interpreted Triton kernels (capture_hidden's kernel bound to
    each launch's layer, the fill_zero / concat start, rotate_residual's sum after the loop): its
    aux_hidden equals the reference executor's, prefill and a decode step."""
    import torch
    from infc.compiler.build import build
    from infc.compiler.contract.safetensors_io import Checkpoint
    from infc.runtime.engine.step import Chunk
    from infc.runtime.reference.executor import ReferenceExecutor
    from infc.runtime.weights.load import load_weights
    from interp_executor import InterpExecutor
    d, _ = target
    out = build(model_dir=str(d), out=tmp_path / "art", compile=False, log=None, page_size=16,
                capture=[L, 0, 2])
    plan = json.loads((out / "plan.json").read_text())
    plan["_dir"] = str(out)
    weights = load_weights(plan, Checkpoint(d))
    ref, run = ReferenceExecutor(plan, weights), InterpExecutor(plan, weights, page_size=16)
    for chunk in (Chunk(0, [3, 17, 99, 5, 250, 8, 1], 0), Chunk(0, [42], 7)):
        ref.step([chunk])
        run.step([chunk])
        want = ref.outputs["aux_hidden"]
        got = run.views[plan["outputs"]["aux_hidden"]].to(torch.float32).numpy()
        assert np.abs(got - want).max() <= 3e-2 * np.abs(want).max(), chunk


# -- the head against a numpy EAGLE-3 --------------------------------------------------------------
def _rms(x, w, eps=1e-6):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope(x, pos, theta):
    D = x.shape[-1]
    ang = pos[:, None] * theta ** (-np.arange(0, D, 2) / D)[None]
    cos, sin = np.cos(np.concatenate([ang, ang], -1))[:, None], np.sin(np.concatenate([ang, ang], -1))[:, None]
    rot = np.concatenate([-x[..., D // 2:], x[..., :D // 2]], -1)
    return x * cos + rot * sin


class NumpyEagle3:
    """EAGLE-3's draft step as its papers and reference servers define it, one sequence: x = fc(aux)
    (or the previous step's pre-norm output), attention over [input_norm(embed(t)) |
    hidden_norm(x)] with its own KV cache, Llama's residual MLP, then norm and lm_head."""
    def __init__(self, ckpt, embed, cfg):
        self.t = {n: ckpt.float32(n) for n in ckpt.where if n not in ("d2t", "t2d")}
        self.embed, self.cfg = embed, cfg
        self.d2t = np.asarray(ckpt.raw("d2t"), np.int64)
        self.K, self.Vv = [], []

    def step(self, x, tokens, pos):
        t, c, m = self.t, self.cfg, "midlayer."
        Hq, Hkv = c["num_attention_heads"], c["num_key_value_heads"]
        D = c["hidden_size"] // Hq
        h = np.concatenate([_rms(self.embed[tokens], t[m + "input_layernorm.weight"]),
                            _rms(x, t[m + "hidden_norm.weight"])], -1)
        q = _rope((h @ t[m + "self_attn.q_proj.weight"].T).reshape(-1, Hq, D), pos, c["rope_theta"])
        k = _rope((h @ t[m + "self_attn.k_proj.weight"].T).reshape(-1, Hkv, D), pos, c["rope_theta"])
        v = (h @ t[m + "self_attn.v_proj.weight"].T).reshape(-1, Hkv, D)
        self.K += list(k)
        self.Vv += list(v)
        K, Vv = np.stack(self.K), np.stack(self.Vv)          # positions 0..pos[-1]
        out = np.zeros_like(q)
        for r, p in enumerate(pos):
            for hq in range(Hq):
                s = K[:p + 1, hq // (Hq // Hkv)] @ q[r, hq] / np.sqrt(D)
                a = np.exp(s - s.max())
                out[r, hq] = (a / a.sum()) @ Vv[:p + 1, hq // (Hq // Hkv)]
        x = x + out.reshape(len(pos), -1) @ t[m + "self_attn.o_proj.weight"].T
        g = _rms(x, t[m + "post_attention_layernorm.weight"])
        act = g @ t[m + "mlp.gate_proj.weight"].T
        x = x + (act / (1 + np.exp(-act)) * (g @ t[m + "mlp.up_proj.weight"].T)) @ t[m + "mlp.down_proj.weight"].T
        logits = _rms(x, t["norm.weight"]) @ t["lm_head.weight"].T
        j = int(np.argmax(logits[-1]))
        return x[-1], j + int(self.d2t[j])

    def truncate(self, n):
        del self.K[n:], self.Vv[n:]


def _head_proposer(head_dir, embed, budget=2048):
    from infc.compiler.build import compile_model
    from infc.compiler.contract.safetensors_io import Checkpoint
    from infc.runtime.engine.runner import CPURunner
    from infc.runtime.engine.speculative.eagle import EagleProposer
    from infc.runtime.weights.load import load_weights
    from infc.compiler.spec import SPECS_DIR
    _, plan = compile_model(model_dir=str(head_dir), spec_path=str(SPECS_DIR / "eagle3.yaml"),
                            check_checkpoint=False)
    ckpt = Checkpoint(head_dir)
    weights = load_weights(dict(plan, weights={k: v for k, v in plan["weights"].items() if k != "embed"}), ckpt)
    weights["embed"] = embed
    runner = CPURunner(plan, weights, num_pages=32, page_size=16)
    return EagleProposer(runner, ckpt.raw("d2t"), budget, 1 << 20), ckpt


def test_proposer_equals_numpy_eagle3(target, tmp_path):
    """Two sequences proposing in the same forwards: a catch-up over their prompts, k chained
    steps each (the head's own hidden state fed back), then one accepted draft and a bonus
    token: the rollback, the catch-up over the target's new rows and the next chain. The drafts
    are the numpy EAGLE-3's, the head's pages back at the end."""
    from infc.runtime.engine.sequence import Sequence
    d, _ = target
    head = write_head(d, tmp_path / "head", draft_vocab=VD, layers=[0, 2, 3], seed=3)
    cfg = json.loads((head / "config.json").read_text())
    rng = np.random.default_rng(0)
    embed = rng.standard_normal((V, H)).astype(np.float32)
    prop, ckpt = _head_proposer(head, embed)
    fc = ckpt.float32("fc.weight")
    params = SamplingParams(max_tokens=50, temperature=0)
    seqs = [Sequence(i, f"r{i}", 0, list(rng.integers(0, V, n)), params, 0) for i, n in ((0, 9), (1, 5))]
    refs = [NumpyEagle3(ckpt, embed, cfg) for _ in seqs]
    aux = {s.seq_id: rng.standard_normal((64, 3 * H)).astype(np.float32) for s in seqs}
    # the target's prefill computed positions 0..n-2 (the last prompt token is sampled from)
    for s in seqs:
        s.token_ids.append(int(rng.integers(V)))        # the first output token
    prop.observe([(s.seq_id, 0, len(s.token_ids) - 1) for s in seqs],
                 np.concatenate([aux[s.seq_id][:len(s.token_ids) - 1] for s in seqs]))
    k = 4
    done = {s.seq_id: 0 for s in seqs}                    # head positions the reference holds
    for rnd in range(2):
        drafts = prop.propose([(s, k) for s in seqs])
        last = prop.runner.outputs()["hidden_out"]      # the chain's last step, one row a sequence
        for b, (s, ref) in enumerate(zip(seqs, refs)):
            Lh = len(s.token_ids) - 1
            pos = np.arange(done[s.seq_id], Lh)
            x, tok = ref.step(aux[s.seq_id][pos] @ fc.T, np.asarray(s.token_ids)[pos + 1], pos)
            want = [tok]
            for j in range(1, k):
                x, tok = ref.step(x[None], np.asarray([tok]), np.asarray([Lh - 1 + j]))
                want.append(tok)
            assert drafts[s.seq_id] == want, (rnd, s.seq_id)
            np.testing.assert_allclose(last[b], x, rtol=1e-4, atol=1e-5)
            ref.truncate(Lh)
            done[s.seq_id] = Lh
        # the target verified: row 0 at position p = Lh and the draft rows; one draft accepted
        for s in seqs:
            p, dr = len(s.token_ids) - 1, drafts[s.seq_id]
            prop.observe([(s.seq_id, p, 1)] + [(s.seq_id, p + 1 + j, 1) for j in range(k)],
                         aux[s.seq_id][p:p + k + 1])
            s.token_ids += [dr[0], int(rng.integers(V))]
            prop.settle(s, 1)
    for s in seqs:
        prop.release(s)
    assert prop.held_pages() == 0 and not prop.hiddens


def test_a_long_catch_up_goes_in_budget_sized_parts(target, tmp_path):
    """A token budget of 4 and 9 head positions to catch up: two steps of 4 proposing nothing,
    then the last position and the chain: the numpy EAGLE-3's drafts over the whole catch-up."""
    from infc.runtime.engine.sequence import Sequence
    d, _ = target
    head = write_head(d, tmp_path / "head", draft_vocab=VD, layers=[0, 2, 3], seed=4)
    cfg = json.loads((head / "config.json").read_text())
    rng = np.random.default_rng(1)
    embed = rng.standard_normal((V, H)).astype(np.float32)
    prop, ckpt = _head_proposer(head, embed, budget=4)
    seq = Sequence(0, "r", 0, [int(t) for t in rng.integers(0, V, 10)], SamplingParams(max_tokens=9), 0)
    aux = rng.standard_normal((9, 3 * H)).astype(np.float32)
    prop.observe([(0, 0, 9)], aux)
    assert prop.propose([(seq, 3)]) == {} and prop.propose([(seq, 3)]) == {}
    drafts = prop.propose([(seq, 3)])[0]
    ref = NumpyEagle3(ckpt, embed, cfg)
    pos = np.arange(9)
    x, tok = ref.step(aux @ ckpt.float32("fc.weight").T, np.asarray(seq.token_ids)[pos + 1], pos)
    want = [tok]
    for j in (1, 2):
        x, tok = ref.step(x[None], np.asarray([tok]), np.asarray([8 + j]))
        want.append(tok)
    assert drafts == want and prop.forwards == 5
    assert not prop.hiddens[0]                      # every row consumed


# -- the engine -----------------------------------------------------------------------------------
def _generate(target_dir, spec=None, n=16, sampled=False):
    """Two greedy requests; (tokens by request, the engine, steps). A step's draft rows are rows
    of its own: max_num_seqs leaves room for every draft."""
    from infc.backend import load_backend
    from infc.compiler.spec import SPECS_DIR
    kw = dict(device="cpu", max_num_seqs=16, log=None, spec=str(SPECS_DIR / "llama.yaml"))
    if spec:
        kw["speculative_config"] = spec
    e = load_backend(target_dir, **kw).engine
    e = getattr(e, "engine", e)
    for i, p in enumerate([[3, 17, 99, 5, 250, 8, 1, 3, 17, 99], [5, 6, 7, 8, 9]]):
        e.add_request(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), f"r{i}")
    if sampled:                     # seeded sampling: plain decoding's draws, token for token
        e.add_request([9, 8, 7], SamplingParams(max_tokens=n, temperature=0.9, seed=11, ignore_eos=True), "s")
    got, steps = {}, 0
    while e.has_unfinished():
        steps += 1
        for o in e.step():
            got.setdefault(o.request_id, []).extend(o.token_ids)
    return got, e, steps


def test_engine_greedy_identical_with_a_random_head(target, tmp_path):
    d, _ = target
    head = write_head(d, tmp_path / "head", draft_vocab=VD, seed=5)    # default layers (2, 2, 1)
    plain, _, _ = _generate(d, sampled=True)
    got, e, _ = _generate(d, {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}, sampled=True)
    assert got == plain and len(got["s"]) == 16
    assert e.metrics.spec_decode_num_draft_tokens_total > 0
    assert e.spec.draft.held_pages() == 0 and not e.spec.draft.shadows


def test_constructed_head_accepts_every_draft(target, tmp_path):
    """A target whose final norm is zero predicts token 0 everywhere (zero logits: argmax 0); a
    head whose final norm is zero proposes its draft id 0, mapped to target id 0: every draft is
    accepted, k + 1 tokens a step (16 tokens: the prefill's, then 4 + 4 + 4 + 3)."""
    import torch
    d, m = target
    zero = tmp_path / "zero-target"
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    with torch.no_grad():
        m.model.norm.weight.zero_()
        m.save_pretrained(zero)
        m.load_state_dict(sd)
    cut = dict(method="eagle3", num_speculative_tokens=3)

    def head(first):
        def edit(t):
            t["norm.weight"][:] = 0
            t["d2t"][0] = first                         # draft id 0 -> target id `first`
        return str(write_head(zero, tmp_path / f"head{first}", draft_vocab=VD, layers=[0, 1, 3], edit=edit))

    # plain decoding's output is 16 zeros (zero logits) in 16 steps, by construction
    got, e, steps = _generate(zero, dict(cut, model=head(0)))
    assert got == {"r0": [0] * 16, "r1": [0] * 16}
    mt = e.metrics
    assert mt.spec_decode_num_accepted_tokens_total == mt.spec_decode_num_draft_tokens_total == 2 * (3 + 3 + 3 + 2)
    assert steps == 5


def test_a_head_for_another_target_is_refused(target, tmp_path):
    """A head whose fc reads hidden states of another width, or of another vocabulary: refused at
    startup, naming what differs."""
    from infc.backend import load_backend
    from infc.compiler.spec import SPECS_DIR
    d, _ = target
    head = write_head(d, tmp_path / "head", draft_vocab=VD, layers=[0, 1, 2])
    cfg = json.loads((head / "config.json").read_text())
    for key, value, message in (("target_hidden_size", 2 * H, r"reads \[T, 384\] target hidden states and the target gives \[T, 192\]"),
                                ("vocab_size", V + 1, "the head's vocabulary has 301 tokens and the target's 300")):
        (head / "config.json").write_text(json.dumps(dict(cfg, **{key: value})))
        with pytest.raises(ValueError, match=message):
            load_backend(d, device="cpu", log=None, spec=str(SPECS_DIR / "llama.yaml"), load_format="dummy",
                         speculative_config={"method": "eagle3", "model": str(head), "num_speculative_tokens": 2})


@pytest.mark.parametrize("old,new,message", [
    ("aux: [T, 3*Ht]", "aux: [3*Ht]", r"input 'aux': its shape must be a list starting with T"),
    ("outputs: [logits, hidden_out]", "outputs: [logits, hiden_out]",
     r"outputs: 'hiden_out' is not a value the graph assigns; did you mean 'hidden_out'"),
    ("outputs: [logits, hidden_out]", "outputs: logits", r"'outputs' must be a list of value names"),
])
def test_spec_inputs_and_outputs_errors_name_the_mistake(target, tmp_path, old, new, message):
    from infc.compiler.build import compile_model
    from infc.compiler.contract.errors import SpecError
    from infc.compiler.spec import SPECS_DIR
    d, _ = target
    head = write_head(d, tmp_path / "head", draft_vocab=VD, layers=[0, 1, 2])
    text = (SPECS_DIR / "eagle3.yaml").read_text()
    assert old in text
    (tmp_path / "eagle3.yaml").write_text(text.replace(old, new))
    with pytest.raises(SpecError, match=message):
        compile_model(model_dir=str(head), spec_path=str(tmp_path / "eagle3.yaml"), check_checkpoint=False)
