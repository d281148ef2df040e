"""Adapters as PEFT publishes them (runtime/lora/peft_dir.py): made by the peft library itself
(random non-zero B, rsLoRA, rank_pattern / alpha_pattern, a regex target_modules) and by
tools/make_lora_adapter.py, served four at a time beside the base model by a LoRA plan's
reference executor, equal to HF + PEFT's float32 logits to 1e-4; malformed adapters refused
naming what is wrong."""
import copy
import json

import numpy as np
import peft
import pytest
import torch

from infc.compiler.build import compile_model
from infc.compiler.contract.safetensors_io import Checkpoint
from infc.config import lora_build
from infc.runtime.lora import tables
from infc.runtime.lora.peft_dir import load_peft
from infc.runtime.reference.executor import ReferenceExecutor, SeqChunk
from infc.runtime.weights.load import load_weights

from make_lora_adapter import make_adapter

TOL = 1e-4
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CONFIGS = [dict(r=8, lora_alpha=16, target_modules=ALL),
           dict(r=16, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj"]),
           dict(r=4, lora_alpha=4, target_modules=["gate_proj", "up_proj", "down_proj"],
                rank_pattern={"down_proj": 12}, alpha_pattern={"down_proj": 6}),
           dict(r=8, lora_alpha=32, target_modules=r".*\.(k_proj|o_proj)")]


def _peft_model(hf, cfg: dict, seed: int, out):
    """HF + PEFT with random non-zero A and B, saved to out."""
    torch.manual_seed(seed)
    pm = peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(lora_dropout=0.0, **cfg))
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn_like(p) * 0.1)
    pm.eval()
    pm.save_pretrained(out)
    return pm


def _hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def _serve(d, adapters, prompts, slots, max_rank=16):
    """Last-row logits of a prefill and a decode step of every prompt, one batch, each with its slot."""
    _, plan = compile_model(model_dir=d, lora=lora_build(len(adapters), max_rank))
    weights = load_weights(plan, Checkpoint(d))
    put = tables.numpy_put(plan, weights)
    for slot, a in enumerate(adapters, 1):
        tables.check(plan, a)
        tables.write(plan, put, slot, a)
    ex = ReferenceExecutor(plan, weights)
    first = ex.step([SeqChunk(i, p[:-1], 0) for i, p in enumerate(prompts)], lora=slots)
    second = ex.step([SeqChunk(i, p[-1:], len(p) - 1) for i, p in enumerate(prompts)], lora=slots)
    return first, second


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_four_peft_adapters_and_the_base_in_one_batch_equal_hf_peft(family, tiny_model, tmp_path):
    d, hf = tiny_model(family)
    models = [_peft_model(hf, c, i, tmp_path / f"a{i}") for i, c in enumerate(CONFIGS)]
    adapters = [load_peft(tmp_path / f"a{i}", f"a{i}") for i in range(len(CONFIGS))]
    gen = np.random.default_rng(3)
    prompts = [[int(t) for t in gen.integers(1, 300, n)] for n in (11, 6, 9, 14, 8)]
    slots = [3, 0, 1, 4, 2]
    first, second = _serve(d, adapters, prompts, slots)
    for i, (p, s) in enumerate(zip(prompts, slots)):
        want = _hf_logits(models[s - 1] if s else hf, p)
        assert np.abs(first[i] - want[-2]).max() <= TOL, (i, s, np.abs(first[i] - want[-2]).max())
        assert np.abs(second[i] - want[-1]).max() <= TOL, (i, s)
        if s:                                     # the adapter moves the logits well past TOL
            assert np.abs(want[-1] - _hf_logits(hf, p)[-1]).max() > 100 * TOL


def test_the_fixture_tool_writes_what_peft_reads(tiny_model, tmp_path):
    d, hf = tiny_model("qwen3")
    make_adapter(d, tmp_path / "fx", rank=8, alpha=12, rslora=True, rank_pattern={"o_proj": 16},
                 alpha_pattern={"up_proj": 3}, seed=5)
    cfg = json.loads((tmp_path / "fx" / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["use_rslora"] is True and cfg["rank_pattern"] == {"o_proj": 16}
    pm = peft.PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path / "fx").eval()
    a = load_peft(tmp_path / "fx", "fx")
    assert a.modules["model.layers.0.self_attn.o_proj"].rank == 16
    assert a.modules["model.layers.0.mlp.up_proj"].scale == pytest.approx(3 / np.sqrt(8))
    prompt = [4, 77, 12, 9, 250, 31, 8]
    first, second = _serve(d, [a], [prompt], [1])
    want = _hf_logits(pm, prompt)
    assert np.abs(first[0] - want[-2]).max() <= TOL and np.abs(second[0] - want[-1]).max() <= TOL
