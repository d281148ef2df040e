"""A LoRA plan through its kernels under the interpreter (codegen_templates/triton/lora_*.py.j2
and every fused kernel around them), a batch mixing four adapters and the base model, against
the reference executor: the prefill, short, decode, wide and narrow programs."""
import json

import numpy as np
import pytest

from infc.compiler.build import build
from infc.compiler.contract.safetensors_io import Checkpoint
from infc.config import lora_build
from infc.runtime.engine.step import Chunk
from infc.runtime.lora import tables
from infc.runtime.reference.executor import ReferenceExecutor, SeqChunk
from infc.runtime.weights.load import load_weights

from interp_executor import InterpExecutor
from lora_fixtures import random_adapter

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


def _four_adapters(d, hf, out, **build_kw) -> tuple[dict, dict]:
    """The tiny model built with 4 adapter slots into out, and its weights with four random
    adapters of ranks 16, 8, 12 and 16 over different targets in slots 1-4."""
    out = build(model_dir=str(d), out=out, compile=False, log=None, page_size=16, lora=lora_build(4, 16),
                **build_kw)
    plan = json.loads((out / "plan.json").read_text())
    plan["_dir"] = str(out)
    # the decode and wide programs at 2+ sequences: the narrow one (decode steps of up to 8 tokens)
    # has its own tests (tests/test_interp_models.py, tests/test_merge_prologues.py)
    plan["narrow_tokens"] = min(plan.get("narrow_tokens", 0), 1)
    weights = load_weights(plan, Checkpoint(d))
    put = tables.numpy_put(plan, weights)
    for slot, (rank, leaves) in enumerate([(16, ALL), (8, ("q_proj", "v_proj")), (12, ALL[4:]),
                                           (16, ("k_proj", "o_proj"))], 1):
        tables.write(plan, put, slot, random_adapter(hf, f"a{slot}", rank, leaves, slot))
    return plan, weights


def test_a_mixed_adapter_batch_through_the_kernels(tiny_model, tmp_path, rng):
    d, hf = tiny_model("qwen3")
    plan, weights = _four_adapters(d, hf, tmp_path / "art")
    plan["short_tokens"] = 16
    ref, run = ReferenceExecutor(plan, weights), InterpExecutor(plan, weights, page_size=16)
    prompts = [[int(t) for t in rng.integers(0, 320, n)] for n in (9, 5, 12, 7, 6)]
    slots = [2, 0, 4, 1, 3]
    got = run.step([Chunk(i, p, 0) for i, p in enumerate(prompts)], lora=slots)
    want = ref.step([SeqChunk(i, p, 0) for i, p in enumerate(prompts)], lora=slots)
    assert run.program == "prefill" and _rel(got, want) < 2e-2
    # the adapters matter here: the same step without them is far off
    base = ReferenceExecutor(plan, weights).step([SeqChunk(i, p, 0) for i, p in enumerate(prompts)])
    assert _rel(base, want) > 0.1
    lens = [len(p) for p in prompts]
    toks = [int(np.argmax(w)) for w in want]
    for i, program in enumerate(("decode", "wide")):
        if program == "wide":
            plan["wide_tokens"] = 5
        got = run.step([Chunk(b, [toks[b]], lens[b]) for b in range(5)], lora=slots)
        want = ref.step([SeqChunk(b, [toks[b]], lens[b]) for b in range(5)], lora=slots)
        assert run.program == program and _rel(got, want) < 2e-2, (program, _rel(got, want))
        lens = [n + 1 for n in lens]
        toks = [int(np.argmax(w)) for w in want]
    # a short mixed step: one sequence's 9 new tokens beside another's decode, adapters swapped
    got = run.step([Chunk(0, prompts[2][:9], lens[0]), Chunk(1, [toks[1]], lens[1])], lora=[3, 1])
    want = ref.step([SeqChunk(0, prompts[2][:9], lens[0]), SeqChunk(1, [toks[1]], lens[1])], lora=[3, 1])
    assert run.program == "short" and _rel(got, want) < 2e-2
    # a batch-1 decode: the narrow program, each LoRA site inside its GEMV's launch (merge_lora),
    # gate|up's expand and activation in the gated GEMV
    got = run.step([Chunk(1, [int(np.argmax(want[1]))], lens[1] + 1)], lora=[1])
    want = ref.step([SeqChunk(1, [int(np.argmax(want[1]))], lens[1] + 1)], lora=[1])
    # 3e-2: this step measured 0.023 (bf16 against the unrounded oracle); on the same tiny model the
    # separate launches' narrow steps measured 0.009 / 0.023 against the merged site's 0.007 / 0.018
    # (adapters 1 / 3), so the bound, not the merge, was tight (bench/NOTES.md, issue 46, lorafuse)
    assert run.program == "narrow" and _rel(got, want) < 3e-2, _rel(got, want)
    assert ("linear", "gemv_gated") in run.templates and not [o for o, _ in run.templates if o.startswith("lora")]


@pytest.mark.parametrize("switch", ["LORA_DECODE_SITES", "LORA_DECODE_EXPAND"])
def test_a_decode_step_of_several_row_blocks_k_ranges_and_splits_takes_the_sites_in_its_gemvs(tiny_model, tmp_path, rng,
                                                                                              monkeypatch, switch):
    """The decode program's LoRA sites inside their GEMVs (codegen_templates/triton/_lora_rows.j2,
    infc/config.py LORA_DECODE_SITES) at tiles that give a 20-row step two row blocks, several
    shrink ranges a block and a K split: the claims, the fixed-order sum, the per-slot delta and
    split 0's single add all run. LORA_DECODE_EXPAND: only the expands in the GEMVs, each shrink
    its own launch just before (gemv.py.j2 LAPART)."""
    import infc.config
    monkeypatch.setattr(infc.config, switch, True)
    d, hf = tiny_model("qwen3")
    tiles = {"BLOCK_T": 16, "BLOCK_K": 16, "FMA_BLOCK_K": 16, "SPLIT_K_DOT": 4, "LORA_KS": 32, "LORA_STEP": 16}
    plan, weights = _four_adapters(d, hf, tmp_path / "art",
                                   tuning_overlay={t: {"default": tiles} for t in ("gemv", "gemv_gated")})
    from infc.compiler.contract.program import launches
    sites = [l for l, _ in launches(plan["programs"]["decode"]) if l.get("lora")]
    apart = switch == "LORA_DECODE_EXPAND"
    assert len(sites) == 4 and all((l["lora"].get("shrink") == "apart") is apart for l in sites)
    for launch in sites:
        meta = plan["kernels"][launch["kernel_id"]]
        assert ("lora_part" in meta.get("scratch", {})) is not apart and meta["constexprs"]["BLOCK_T"] == 16
    ref, run = ReferenceExecutor(plan, weights), InterpExecutor(plan, weights, page_size=16, num_pages=64)
    n = 20
    prompts = [[int(t) for t in rng.integers(0, 320, 2 + i % 3)] for i in range(n)]
    slots = [i % 5 for i in range(n)]
    want = ref.step([SeqChunk(i, p, 0) for i, p in enumerate(prompts)], lora=slots)
    run.step([Chunk(i, p, 0) for i, p in enumerate(prompts)], lora=slots)
    toks = [int(np.argmax(w)) for w in want]
    got = run.step([Chunk(b, [toks[b]], len(prompts[b])) for b in range(n)], lora=slots)
    want = ref.step([SeqChunk(b, [toks[b]], len(prompts[b])) for b in range(n)], lora=slots)
    lora_ops = sorted({o for o, _ in run.templates if o.startswith("lora")})
    assert run.program == "decode" and lora_ops == (["lora_shrink"] if apart else [])
    assert ("linear", "gemv_gated") in run.templates
    assert _rel(got, want) < 2e-2, _rel(got, want)
