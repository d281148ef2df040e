"""GPT-OSS's own checkpoint layout: MXFP4 experts in one parameter per projection
(`mlp.experts.gate_up_proj_blocks` U8 [E, 2F, H/32, 16] and `_scales` [E, 2F, H/32], gate|up
interleaved row by row; `down_proj_blocks` / `_scales`; the biases bf16), under the config's
`quantization_config: {quant_method: mxfp4}`. specs/gpt_oss.yaml names the bf16 parameters; the
quantization pass reads the format's tensors of each parameter instead (compiler/passes/
quantize_experts.py). The tiny model's experts are quantized here (tools/quant_math.py) and
transformers' own MXFP4 converter dequantizes them back into HF's model, the format's definition:
the reference executor equals it at every position (float32), and the interpreted kernels (the
quantized expert GEMMs with their biases and the clamped SwiGLU) equal the reference.
"""
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from infc.compiler.build import build, compile_model
from infc.compiler.contract.safetensors_io import Checkpoint
from infc.runtime.engine.step import Chunk
from infc.runtime.reference.executor import ReferenceExecutor, SeqChunk
from infc.runtime.weights.load import load_weights
from infc.runtime.weights.quant_pack import pack_nibbles

from families import VOCAB, _randomize
from interp_executor import InterpExecutor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
from quant_math import MX_BLOCK, mxfp4_quantize  # noqa: E402

PROMPT = [int(t) for t in np.random.default_rng(7).integers(0, VOCAB, 16)]
SKIP = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def _quantize(w: torch.Tensor):
    """HF's [E, K, N] parameter -> (blocks U8 [E, N, K/32, 16], scales U8 [E, N, K/32])."""
    blocks, scales = [], []
    for m in w.transpose(1, 2).numpy():
        codes, exps = mxfp4_quantize(m)
        blocks.append(pack_nibbles(codes).reshape(m.shape[0], -1, MX_BLOCK // 2))
        scales.append(exps)
    return (torch.from_numpy(np.ascontiguousarray(np.stack(blocks))),
            torch.from_numpy(np.ascontiguousarray(np.stack(scales))))


@pytest.fixture(scope="module")
def mxfp4_model(tmp_path_factory):
    from transformers import GptOssConfig, GptOssForCausalLM
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    torch.manual_seed(1)          # (seed 5 puts a routing tie within bf16 noise: HF bf16 is 24 % off)
    # F = 64 and H = 96: whole 32-element blocks along both projections' K
    hf = GptOssForCausalLM(GptOssConfig(
        vocab_size=VOCAB, max_position_embeddings=128, initializer_range=0.05, hidden_size=96,
        intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, num_local_experts=4, num_experts_per_tok=2, rms_norm_eps=1e-5, sliding_window=5,
        swiglu_limit=0.6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "truncate": False,
                         "original_max_position_embeddings": 32})).float().eval()
    hf.set_attn_implementation("eager")
    _randomize(hf)
    packed = {}
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            for proj in ("gate_up_proj", "down_proj"):
                p = getattr(layer.mlp.experts, proj)
                blocks, scales = _quantize(p.data)
                p.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))  # HF's definition
                name = f"model.layers.{i}.mlp.experts.{proj}"
                packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
    d = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    hf.save_pretrained(d)
    tensors = load_file(d / "model.safetensors")
    for name in {n.rsplit("_", 1)[0] for n in packed}:      # the bf16 parameters: gone
        del tensors[name]
    save_file({**tensors, **packed}, d / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": SKIP}
    (d / "config.json").write_text(json.dumps(cfg))
    with torch.no_grad():
        want = hf(torch.tensor([PROMPT])).logits[0].numpy()
    return d, want


def test_mxfp4_experts_equal_the_format_definition(mxfp4_model):
    d, want = mxfp4_model
    _, plan = compile_model(model_dir=str(d))
    stacks = {n: w for n, w in plan["weights"].items() if "we_" in n and w["dtype"] == "e2m1"}
    assert {n.split("_q")[0] for n in stacks} >= {"we_gate_up", "we_down"}, sorted(plan["weights"])
    ex = ReferenceExecutor(plan, load_weights(plan, Checkpoint(d)))
    got = ex.step([SeqChunk(n, PROMPT[:n], 0) for n in range(1, len(PROMPT) + 1)])
    err = np.abs(got - want).max(axis=1)
    assert err.max() <= 1e-4, f"worst position {int(err.argmax())}, |diff| {err.max():.2e}"


def test_mxfp4_experts_through_the_kernels(mxfp4_model, tmp_path):
    d, _ = mxfp4_model
    out = build(model_dir=str(d), out=tmp_path / "art", compile=False, log=None, page_size=16)
    plan = json.loads((out / "plan.json").read_text())
    plan["_dir"] = str(out)
    weights = load_weights(plan, Checkpoint(d))
    ref, run = ReferenceExecutor(plan, weights), InterpExecutor(plan, weights, page_size=16)
    rel = lambda a, b: float(np.linalg.norm(a - b) / np.linalg.norm(b))      # noqa: E731
    got, want = run.step([Chunk(0, PROMPT, 0)]), ref.step([SeqChunk(0, PROMPT, 0)])
    assert rel(got, want) < 2e-2, ("prefill", rel(got, want))
    tok = int(np.argmax(want[0]))
    got, want = run.step([Chunk(0, [tok], len(PROMPT))]), ref.step([SeqChunk(0, [tok], len(PROMPT))])
    assert rel(got, want) < 2e-2, ("decode", rel(got, want))


def test_mxfp4_experts_over_expert_parallel_ranks(mxfp4_model):
    """Each rank reads its experts' rows of the MXFP4 blocks and scales (and of the biases): the
    ranks' logits equal the single-rank plan's."""
    from test_data_parallel import _check, dp
    from test_parallel import ranked, single
    d, _ = mxfp4_model
    one, (many, plans) = single(d), ranked(d, **dp(2))
    assert all(w["dtype"] == "e2m1" for p in plans for n, w in p["weights"].items()
               if n in ("we_gate_up", "we_down"))
    assert _check(many, one, [[SeqChunk(0, PROMPT[:9], 0)], [SeqChunk(1, PROMPT[9:], 0)]]) <= 1e-4


def test_mxfp4_experts_upcast_once_in_many_token_steps(mxfp4_model, tmp_path, monkeypatch):
    """compiler/passes/upcast_experts.py at 1 token an expert (4 experts, 2 a token: steps of 2
    rows or more): the prefill and mixed programs dequantize each layer's stacks to bf16 once and
    the grouped GEMMs read them; a step of fewer rows reads the codes, and so does every decode
    step (the wide program's grouped GEMMs at 2 decodes too). The logits through the interpreted
    kernels are those of a build whose threshold no step reaches (bit for bit: the GEMMs' tile is
    the upcast value) and the reference's."""
    import infc.config
    from infc.compiler.contract.program import launches
    d, _ = mxfp4_model
    rel = lambda a, b: float(np.linalg.norm(a - b) / np.linalg.norm(b))      # noqa: E731
    got = {}
    for label, per_expert, rows in (("stack", 1, 2), ("codes", 10 ** 6, 2 * 10 ** 6)):
        monkeypatch.setattr(infc.config, "UPCAST_EXPERTS", True)
        monkeypatch.setattr(infc.config, "UPCAST_TOKENS_PER_EXPERT", per_expert)
        out = build(model_dir=str(d), out=tmp_path / label, compile=False, log=None, page_size=16)
        plan = json.loads((out / "plan.json").read_text())
        plan["_dir"] = str(out)
        for p, prog in plan["programs"].items():
            ups = [la for la, _ in launches(prog) if la["op"] == "expert_upcast"]
            experts = [la for la, _ in launches(prog) if la["op"] in ("moe_gate_up", "moe_down")]
            assert len(ups) == (len(experts) if p in ("prefill", "mixed") else 0), p
            assert all(la["attrs"]["rows"] == rows for la in ups)
            if ups:
                assert all(la["attrs"]["upcast_rows"] == rows and la["inputs"][-1] == up["outputs"][0]
                           for la, up in zip(experts, ups))
        weights = load_weights(plan, Checkpoint(d))
        ref = ReferenceExecutor(plan, weights)
        plan["short_tokens"] = 0                     # every prompt on the prefill program
        run = InterpExecutor(plan, weights, page_size=16)
        got[label] = run.step([Chunk(0, PROMPT, 0)])
        upcasts = sum(op == "expert_upcast" for op, _ in run.templates)
        assert run.program == "prefill" and upcasts == (2 * 3 if label == "stack" else 0), (label, upcasts)
        got["ref-" + label] = ref.step([SeqChunk(0, PROMPT, 0)])
        assert rel(got[label], got["ref-" + label]) < 2e-2
        one = run.step([Chunk(1, PROMPT[:1], 0)])        # 1 row: below 2, the codes
        assert run.program == "prefill" and not any(op == "expert_upcast" for op, _ in run.templates)
        assert rel(one, ref.step([SeqChunk(1, PROMPT[:1], 0)])) < 2e-2
        plan["wide_tokens"] = 2                          # 2 decodes: the wide program, on the codes
        toks = [int(np.argmax(got[label][0])), int(np.argmax(one[0]))]
        dec = run.step([Chunk(0, [toks[0]], len(PROMPT)), Chunk(1, [toks[1]], 1)])
        assert run.program == "wide" and not any(op == "expert_upcast" for op, _ in run.templates)
        assert any(t == "moe_gate_up_grouped" for _, t in run.templates)
        want = ref.step([SeqChunk(0, [toks[0]], len(PROMPT)), SeqChunk(1, [toks[1]], 1)])
        assert rel(dec, want) < 2e-2
        del plan["wide_tokens"]
    assert np.array_equal(got["stack"], got["codes"])
    # the reference reads the stack the upcast wrote as the kernels do: the same float32 values
    assert np.array_equal(got["ref-stack"], got["ref-codes"])
    # the stack's bf16 copy, the GEMMs' last input, is no weight: each weight keeps its role
    from infc.compiler.contract.weight_roles import quant_roles
    assert quant_roles(plan) == quant_roles(compile_model(model_dir=str(d), skip=("upcast_experts",))[1])
    assert any(role == "w_scale" for role, _, _ in quant_roles(plan).values())


def test_reference_reads_the_upcast_stack_at_its_rows_alone(mxfp4_model, tmp_path, monkeypatch):
    """The reference executor runs an upcast plan as the GPU does: expert_upcast writes its stack
    in steps of at least its rows only (below them its grid is empty, the buffer keeps the arena's
    NaN poison), and the experts' references read that stack there and the codes below, so the
    stack is dequantized once a step (not again by each expert op) and a plan whose stack buffer is
    not live where the GEMMs read it shows up in the reference's logits."""
    import infc.config
    from infc.compiler.ops import REGISTRY
    d, _ = mxfp4_model
    monkeypatch.setattr(infc.config, "UPCAST_EXPERTS", True)
    monkeypatch.setattr(infc.config, "UPCAST_TOKENS_PER_EXPERT", 1)       # rows 2
    out = build(model_dir=str(d), out=tmp_path / "art", compile=False, log=None, page_size=16)
    plan = json.loads((out / "plan.json").read_text())
    plan["short_tokens"] = 0                          # the prompts on the prefill program
    weights = load_weights(plan, Checkpoint(d))
    want = {n: ReferenceExecutor(plan, weights).step([SeqChunk(0, PROMPT[:n], 0)]) for n in (1, len(PROMPT))}
    upcast = REGISTRY["expert_upcast"]
    exact, calls = upcast.reference, []

    def halved(ctx, *args, **attrs):              # a stack the experts would read wrongly
        w = exact(ctx, *args, **attrs)
        calls.append((ctx.T, w is None))
        return None if w is None else w * 0.5
    monkeypatch.setattr(upcast, "reference", halved)
    got = {n: ReferenceExecutor(plan, weights).step([SeqChunk(0, PROMPT[:n], 0)]) for n in (1, len(PROMPT))}
    assert np.array_equal(got[1], want[1])                 # 1 row: the codes, nothing written
    assert not np.allclose(got[len(PROMPT)], want[len(PROMPT)], atol=1e-3)
    assert set(calls) == {(1, True), (len(PROMPT), False)}


def test_upcast_launches_keep_the_codes_gemms_tuning_keys(mxfp4_model, monkeypatch):
    """The expert launches that read an upcast stack are keyed in the tuning tables as without it
    (compiler/codegen/render.py tuning_key): the wide program's tuned tiles apply to them (on an
    H200 the stack's input in the key lost GPT-OSS-20B's wide entry, 87.6 -> 114.4 us a decoded
    token at 256 concurrent: bench/NOTES.md)."""
    import infc.config
    from infc.compiler.codegen.render import tuning_key
    from infc.compiler.contract.program import launches
    d, _ = mxfp4_model

    def keys(plan):
        return {p: [tuning_key(plan, la, p) for la, _ in launches(prog) if la["op"] in ("moe_gate_up", "moe_down")]
                for p, prog in plan["programs"].items()}
    codes = keys(compile_model(model_dir=str(d))[1])
    monkeypatch.setattr(infc.config, "UPCAST_EXPERTS", True)
    _, plan = compile_model(model_dir=str(d))
    assert any(la["attrs"].get("has_w_upcast") for prog in plan["programs"].values() for la, _ in launches(prog))
    assert keys(plan) == codes and codes["wide"]


def test_upcast_rows_count_the_models_experts_and_the_pass_keeps_its_bounds(mxfp4_model, monkeypatch):
    """rows = 64 tokens an expert x 4 experts / 2 a token, the same on an expert-parallel rank
    (which holds 2 of the 4 and whose ids name the model's; a data-parallel plan counts G, every
    rank's rows); no upcast under --no-fuse, nor for a stack over UPCAST_MAX_BYTES, nor with
    infc/config.py UPCAST_EXPERTS off; on by default."""
    import infc.config
    from infc.compiler.build import compile_ranks
    from infc.compiler.contract.program import launches
    from test_data_parallel import dp
    from test_parallel import settings
    d, _ = mxfp4_model

    def upcasts(plan):
        return [la["attrs"] for prog in plan["programs"].values() for la, _ in launches(prog)
                if la["op"] == "expert_upcast"]

    state, plan = compile_model(model_dir=str(d))
    assert {(a["rows"], a["dim"]) for a in upcasts(plan)} == {(128, "T")}
    monkeypatch.setattr(infc.config, "UPCAST_EXPERTS", False)
    assert not upcasts(compile_model(model_dir=str(d))[1])
    monkeypatch.setattr(infc.config, "UPCAST_EXPERTS", True)
    ranks = compile_ranks(settings(**dp(2)), model_dir=str(d))
    for _, p in ranks:
        assert p["weights"]["we_gate_up"]["shape"][0] == 2
        assert {(a["rows"], a["dim"]) for a in upcasts(p)} == {(128, "G")}
    assert not upcasts(compile_model(model_dir=str(d), fuse=False)[1])
    monkeypatch.setattr(infc.config, "UPCAST_MAX_BYTES", 4 * 96 * 64 * 2)   # down's bf16 stack fits, gate|up's not
    state, plan = compile_model(model_dir=str(d))
    assert {la["inputs"][0] for prog in plan["programs"].values() for la, _ in launches(prog)
            if la["op"] == "expert_upcast"} == {"we_down"}
    note = " ".join(m for p, m in state.log if p == "upcast_experts")
    assert "kept on codes" in note and "we_gate_up" in note
