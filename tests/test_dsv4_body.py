"""DeepSeek-V4's body ops in a spec, end to end: a tiny model made of transformers' own DeepSeek-V4
modules -- hyper-connections around each sublayer (DeepseekV4HyperConnection), the hash-routed and
the sqrtsoftplus top-k MoE with the clamped-SwiGLU shared expert (DeepseekV4SparseMoeBlock), the
hyper head (DeepseekV4HyperHead) -- with the attention replaced by one linear (the attention is
another issue's half), as a spec writes it: the reference executor's logits against the torch
model at every position, and the fused plan's kernels under the interpreter against the reference
executor. The spec's layer graph is the one the deepseek_v4 spec wires (docs/spec-reference.md)."""
import json

import numpy as np
import torch

from infc.compiler.build import build, compile_model
from infc.compiler.contract.safetensors_io import Checkpoint
from infc.runtime.reference.executor import ReferenceExecutor, SeqChunk
from infc.runtime.weights.load import load_weights

from exhaustive import EXHAUSTIVE

CFG = dict(hidden_size=24, intermediate_size=20, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
           vocab_size=40, hc_mult=4, hc_sinkhorn_iters=6, hc_eps=1e-6, rms_norm_eps=1e-6, swiglu_limit=0.8,
           n_routed_experts=6, num_experts_per_tok=2, routed_scaling_factor=1.5, mlp_layer_types=["hash_moe", "moe"])

MHC = """\
        - mix = hc_mix(x, {w}_fn, eps)
        - pre, post, comb = hc_weights(mix, {w}_base, {w}_scale, iters=I, eps=hc_eps)
        - h = rms_norm(hc_collapse(x, pre), {norm}, eps)
"""
MOE = """\
        - s = mul(silu(clamp(linear(h, sh_gate), max=lim)), clamp(linear(h, sh_up), min=-lim, max=lim))
        - y = add(moe_experts(h, w, ids, gate, up, down, act="clamped_silu", limit=lim), linear(s, sh_down))
        - x = hc_expand(y, x, post, comb)
        - tokens = view(tokens, [T])
"""
ROUTE = {
    "hash": "        - w, ids = moe_route_table(tokens, table, logits=linear(h, router), scoring=\"sqrtsoftplus\", "
            "normalize=true, scale=rsf)\n",
    "topk": "        - w, ids = moe_route(linear(h, router), K, true, scale=rsf, scoring=\"sqrtsoftplus\", bias=ecb)\n",
}
BODY = MHC.format(w="attn", norm="in_norm") + "        - x = hc_expand(linear(h, wo), x, post, comb)\n" \
    + MHC.format(w="ffn", norm="post_norm")
P = "l.{i}."
SPEC = f"""
family: dsv4_body
architectures: [Dsv4BodyForTest]
config:
  H: hidden_size
  F: intermediate_size
  L: num_hidden_layers
  V: vocab_size
  N: hc_mult
  I: hc_sinkhorn_iters
  hc_eps: hc_eps
  eps: rms_norm_eps
  lim: swiglu_limit
  E: n_routed_experts
  K: num_experts_per_tok
  rsf: routed_scaling_factor
  kinds: mlp_layer_types
  M: = (2 + N) * N
  NH: = N * H
weights:
  embed:      {{name: embed.weight, shape: [V, H]}}
  head_fn:    {{name: hc_head.hc_fn, shape: [N, NH]}}
  head_base:  {{name: hc_head.hc_base, shape: [N]}}
  head_scale: {{name: hc_head.hc_scale, shape: [1]}}
  final_norm: {{name: norm.weight, shape: [H]}}
  lm_head:    {{name: lm_head.weight, shape: [V, H]}}
layer:
  kind: "'hash' if kinds[i] == 'hash_moe' else 'topk'"
  weights:
    attn_fn:    {{name: "{P}attn_hc.fn", shape: [M, NH]}}
    attn_base:  {{name: "{P}attn_hc.base", shape: [M]}}
    attn_scale: {{name: "{P}attn_hc.scale", shape: [3]}}
    ffn_fn:     {{name: "{P}ffn_hc.fn", shape: [M, NH]}}
    ffn_base:   {{name: "{P}ffn_hc.base", shape: [M]}}
    ffn_scale:  {{name: "{P}ffn_hc.scale", shape: [3]}}
    in_norm:    {{name: "{P}input_layernorm.weight", shape: [H]}}
    post_norm:  {{name: "{P}post_attention_layernorm.weight", shape: [H]}}
    wo:         {{name: "{P}wo.weight", shape: [H, H]}}
    router:     {{name: "{P}mlp.gate.weight", shape: [E, H]}}
    gate:       {{name: "{P}mlp.experts.gate_up_proj", shape: [F, H], rows: [0, F], experts: E}}
    up:         {{name: "{P}mlp.experts.gate_up_proj", shape: [F, H], rows: [F, 2 * F], experts: E}}
    down:       {{name: "{P}mlp.experts.down_proj", shape: [H, F], experts: E}}
    sh_gate:    {{name: "{P}mlp.shared_experts.gate_proj.weight", shape: [F, H]}}
    sh_up:      {{name: "{P}mlp.shared_experts.up_proj.weight", shape: [F, H]}}
    sh_down:    {{name: "{P}mlp.shared_experts.down_proj.weight", shape: [H, F]}}
  kinds:
    hash:
      weights:
        table:  {{name: "{P}mlp.gate.tid2eid", shape: [V, K], dtype: i32}}
      graph:
{BODY}{ROUTE["hash"]}{MOE}
    topk:
      weights:
        ecb:    {{name: "{P}mlp.gate.e_score_correction_bias", shape: [E]}}
      graph:
{BODY}{ROUTE["topk"]}{MOE}
graph:
  - x = hc_streams(embedding(tokens, embed), n=N)
  - x, tok = layers(x, tokens)
  - x = last(x)                    # the hyper head works token by token: only the rows sampled
  - mix = hc_mix(x, head_fn, eps)
  - h = rms_norm(hc_collapse(x, hc_head_weights(mix, head_base, head_scale, eps=hc_eps)), final_norm, eps)
  - logits = linear(h, lm_head)
"""


def _body(gen):
    """The torch model: DeepseekV4DecoderLayer's forward with self_attn replaced by `wo`."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as m
    cfg = m.DeepseekV4Config(**CFG)
    mods = torch.nn.ModuleDict({"embed": torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size),
                                "hc_head": m.DeepseekV4HyperHead(cfg), "norm": m.DeepseekV4RMSNorm(cfg.hidden_size),
                                "lm_head": torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)})
    for i in range(cfg.num_hidden_layers):
        mods[f"l{i}"] = torch.nn.ModuleDict({
            "attn_hc": m.DeepseekV4HyperConnection(cfg), "ffn_hc": m.DeepseekV4HyperConnection(cfg),
            "input_layernorm": m.DeepseekV4RMSNorm(cfg.hidden_size), "post_attention_layernorm": m.DeepseekV4RMSNorm(cfg.hidden_size),
            "wo": torch.nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False), "mlp": m.DeepseekV4SparseMoeBlock(cfg, i)})
    mods = mods.float()
    with torch.no_grad():
        for name, p in mods.named_parameters():
            scale = 1.0 if "embed" in name or "norm" in name or "scale" in name else 0.4
            p.copy_(torch.from_numpy((gen.standard_normal(tuple(p.shape)) * scale).astype(np.float32)))
        for i in range(cfg.num_hidden_layers):
            g = mods[f"l{i}"]["mlp"].gate
            if hasattr(g, "tid2eid"):
                g.tid2eid.copy_(torch.from_numpy(np.stack([gen.choice(6, 2, replace=False) for _ in range(40)])))
            else:
                g.e_score_correction_bias.copy_(torch.from_numpy(gen.standard_normal(6).astype(np.float32) * 0.3))

    def forward(tokens):
        ids = torch.tensor([tokens])
        x = mods["embed"](ids).unsqueeze(2).expand(-1, -1, cfg.hc_mult, -1).contiguous()
        for i in range(cfg.num_hidden_layers):
            lay = mods[f"l{i}"]
            post, comb, h = lay["attn_hc"](x)
            x = post.unsqueeze(-1) * lay["wo"](lay["input_layernorm"](h)).unsqueeze(-2) + comb.transpose(-1, -2) @ x
            post, comb, h = lay["ffn_hc"](x)
            y = lay["mlp"](lay["post_attention_layernorm"](h), input_ids=ids)
            x = post.unsqueeze(-1) * y.unsqueeze(-2) + comb.transpose(-1, -2) @ x
        return mods["lm_head"](mods["norm"](mods["hc_head"](x)))[0]

    names = {}
    for k, v in mods.state_dict().items():
        k = k.replace("l0.", "l.0.").replace("l1.", "l.1.").replace("mlp.gate.", "mlp.gate.")
        names[k] = v.numpy().astype(np.float32) if v.dtype.is_floating_point else v.numpy()
    return forward, names


def _model(tmp_path):
    """(torch forward, model dir, spec path, prompt)."""
    from safetensors.numpy import save_file
    gen = np.random.default_rng(0)
    forward, tensors = _body(gen)
    d = tmp_path / "m"
    d.mkdir()
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({**CFG, "architectures": ["Dsv4BodyForTest"], "torch_dtype": "float32"}))
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC)
    prompt = [int(v) for v in gen.integers(0, 40, 9)]
    return forward, d, spec, prompt


def test_dsv4_body_spec_vs_hf(tmp_path):
    forward, d, spec, prompt = _model(tmp_path)
    with torch.no_grad():
        want = forward(prompt).numpy()
    _, plan = compile_model(model_dir=str(d), spec_path=str(spec))
    weights = load_weights(plan, Checkpoint(d))
    got = ReferenceExecutor(plan, weights).step([SeqChunk(k, prompt[:k], 0) for k in range(1, len(prompt) + 1)])
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
    ops = json.dumps(plan["programs"]["prefill"])
    for name in ("hc_mix", "hc_weights", "hc_collapse", "hc_expand", "hc_streams", "hc_head_weights", "clamped_silu", "sqrtsoftplus"):
        assert name in ops, name



@EXHAUSTIVE
def test_dsv4_body_kernels(tmp_path):
    """The fused plan's kernels under the interpreter, one prefill of the whole prompt, against the
    reference executor (bf16 activations: 2e-2 relative)."""
    from infc.runtime.engine.step import Chunk
    from interp_executor import InterpExecutor
    _, d, spec, prompt = _model(tmp_path)
    out = build(model_dir=str(d), spec_path=str(spec), out=tmp_path / "art", compile=False, log=None, page_size=16)
    plan = json.loads((out / "plan.json").read_text())
    plan["_dir"] = str(out)
    weights = load_weights(plan, Checkpoint(d))
    interp, reference = InterpExecutor(plan, weights, page_size=16), ReferenceExecutor(plan, weights)
    got = interp.step([Chunk(0, prompt, 0)])
    ref = reference.step([SeqChunk(0, prompt, 0)])
    # a decode step (the decode kernels: GEMVs, the decode expert kernels' clamped_silu)
    nxt = int(np.argmax(got[-1]))
    got = interp.step([Chunk(0, [nxt], len(prompt))])
    ref = reference.step([SeqChunk(0, [nxt], len(prompt))])
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 2e-2
    kernels = {k["template"] if isinstance(k, dict) and "template" in k else kid for kid, k in plan["kernels"].items()}
    assert any("hc_weights" in str(k) for k in kernels), sorted(map(str, kernels))[:40]
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 2e-2


def test_dsv4_body_spec_errors(tmp_path):
    """A wrong hyper-connection call in a spec fails naming the op, the fault and the spec line."""
    from infc.compiler.contract.errors import SpecError
    import pytest
    _, d, spec, _ = _model(tmp_path)
    for old, new, msg in [("iters=I", "iters=0", "hc_weights iters (hc_sinkhorn_iters) must be an int >= 1, got 0"),
                          ("hc_expand(y, x, post, comb)", "hc_expand(y, x, comb, post)", "hc_expand post must be [T, N]"),
                          ("logits=linear(h, router), ", "", "give logits=")]:
        bad = tmp_path / "bad.yaml"
        bad.write_text(SPEC.replace(old, new, 1))
        with pytest.raises(SpecError, match=r"bad\.yaml:\d+") as e:
            compile_model(model_dir=str(d), spec_path=str(bad))
        assert msg in str(e.value), str(e.value)


def test_dsv4_body_ranks(tmp_path):
    """Two simulated ranks, TP x EP: the streams and their hyper-connection ops stay whole on each
    rank (replicated around the sharded linears and experts); the logits are the single rank's."""
    from infc.compiler.build import compile_ranks
    from infc.compiler.parallel import settings
    from infc.runtime.reference.ranks import RankExecutor
    _, d, spec, prompt = _model(tmp_path)
    plans = [p for _, p in compile_ranks(settings(tensor_parallel_size=2, enable_expert_parallel=True),
                                         model_dir=str(d), spec_path=str(spec))]
    body = json.dumps(plans[0]["programs"]["prefill"])
    assert '"ep_dispatch"' in body and '"all_reduce"' in body and '"hc_expand"' in body
    many = RankExecutor(plans, [load_weights(p, Checkpoint(d)) for p in plans])
    _, plan = compile_model(model_dir=str(d), spec_path=str(spec))
    one = ReferenceExecutor(plan, load_weights(plan, Checkpoint(d)))
    assert np.abs(many.step([SeqChunk(0, prompt, 0)]) - one.step([SeqChunk(0, prompt, 0)])).max() <= 1e-5
