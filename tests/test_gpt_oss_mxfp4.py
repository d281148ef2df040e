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
