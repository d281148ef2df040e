"""runtime/cuda/weights.py without a GPU: a fake context (tests/fake_cuda.py) whose device memory
is host bytes. The streamed bytes of every weight (direct preads, stacked experts, fused
concatenations, f32 checkpoints converted in numpy, tiny staging buffers that split tensors)
equal the plan's weights as the numpy loader builds them; staging memory is given back; a broken
directory is a clear error; a derived weight (the load program's) is allocated, never built or
copied."""
import os
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from infc.compiler.build import compile_model
from infc.compiler.contract.errors import ModelDirError
from infc.compiler.contract.schema import nbytes
from infc.runtime.cuda import weights as dw
from infc.compiler.contract.safetensors_io import Checkpoint, f32_to_bf16_bits
from infc.runtime.weights.load import iter_weights

from fake_cuda import FakeContext

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))


def model(tmp_path, family, dtype="bf16", **over):
    from make_random_model import write_random_model
    from infc.compiler.spec import find_architecture
    cfg = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, vocab_size=300, max_position_embeddings=256,
               rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    arch = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "llama": "LlamaForCausalLM",
            "deepseek_v2": "DeepseekV2ForCausalLM"}[family]
    if family == "deepseek_v2":      # latent attention, experts reshaped
        cfg.update(num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                   moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                   first_k_dense_replace=1, routed_scaling_factor=1.0, topk_method="greedy", n_group=1,
                   topk_group=1, norm_topk_prob=False, scoring_func="softmax")
    if family == "qwen3_moe":
        cfg.update(moe_intermediate_size=32, num_experts=6, num_experts_per_tok=2, norm_topk_prob=True,
                   decoder_sparse_step=1, mlp_only_layers=[])
    cfg.update(over)
    cfg["architectures"] = [arch]
    spec = find_architecture([arch])
    write_random_model(spec, cfg, tmp_path, seed=1, dtype=dtype, tokenizer=None, max_shard_bytes=40_000)
    _, plan = compile_model(model_dir=str(tmp_path))
    return plan


@pytest.mark.parametrize("family,dtype,staging", [("qwen3", "bf16", 4096), ("qwen3_moe", "bf16", 10_000),
                                                  ("llama", "f32", 1 << 20), ("qwen3", "bf16", 1 << 20),
                                                  ("deepseek_v2", "bf16", 10_000)])
def test_streamed_weights_equal_the_plan(tmp_path, monkeypatch, family, dtype, staging):
    plan = model(tmp_path, family, dtype, **({"tie_word_embeddings": True} if family == "llama" else {}))
    moved, bits = [], dw._bf16_moved

    def counted(w, layer, ckpt):                    # the weights built on their bf16 bits
        got = bits(w, layer, ckpt)
        moved.append(got is not None)
        return got
    monkeypatch.setattr(dw, "_bf16_moved", counted)
    monkeypatch.setattr(dw, "STAGING", staging)
    monkeypatch.setattr(dw, "PIECE", 1000)          # many preads per buffer, unaligned
    ctx = FakeContext()
    w = dw.DeviceWeights(ctx, plan, tmp_path, progress=False, threads=3)
    ckpt = Checkpoint(tmp_path)
    seen = 0
    for name, layer, a in iter_weights(plan, ckpt):
        if isinstance(a, str):
            assert w.ptrs[name] == w.ptrs[a]
            continue
        ptr = w.ptr(name, layer)
        assert ptr % dw.ALIGN == 0
        bits = f32_to_bf16_bits(a)                  # the numpy loader's float32, rounded once
        assert ctx.read(ptr, bits.nbytes) == bits.tobytes(), (name, layer)
        seen += bits.nbytes
    assert seen == w.bytes > 0
    assert ctx.pinned_live == []                    # staging given back
    if staging < 1 << 20:
        assert ctx.num_copies > 4                        # tensors really were split across buffers
    # moved on the bits: the MoE families' experts (gate|up concatenated along columns, reshaped);
    # no weight of an f32 checkpoint, nothing in a dense bf16 one (every weight a run of file bytes)
    assert any(moved) == (family in ("qwen3_moe", "deepseek_v2")), (family, moved)


def test_a_background_load_writes_the_same_bytes_after_zeroing_and_raises_at_wait(tmp_path, monkeypatch):
    """background=True (INFC_LOAD_OVERLAP): the allocation is zeroed first (kernels run meanwhile
    read finite values: a derived weight's room reads 0, not the fake's poison), the checkpoint's
    bytes stream in a thread of their own and after wait() equal the foreground load's, staging
    given back; a truncated shard is the same ModelDirError, raised by wait(); cancel() stops a
    load early."""
    from fake_cuda import POISON
    plan = model(tmp_path, "qwen3_moe")
    stack = next(n for n, w in plan["weights"].items() if len(w["shape"]) == 3 and w["layers"])
    w = plan["weights"][stack]
    plan = {**plan, "weights": {**plan["weights"], "wd_bf16": {
        "shape": w["shape"], "dtype": "bf16", "layers": w["layers"],
        "source": {"derived": {"by": "expert_upcast", "from": [stack], "shape": w["shape"]}}}}}
    monkeypatch.setattr(dw, "STAGING", 4096)
    fg_ctx, bg_ctx = FakeContext(), FakeContext()
    fg = dw.DeviceWeights(fg_ctx, plan, tmp_path, progress=False)
    bg = dw.DeviceWeights(bg_ctx, plan, tmp_path, progress=False, background=True)
    bg.wait()
    assert not bg.loading and bg_ctx.pinned_live == []
    for name, ws in plan["weights"].items():
        size = nbytes(ws["dtype"], ws["shape"])
        for layer in ws["layers"] or [None]:
            got = bg_ctx.read(bg.ptr(name, layer), size)
            if name == "wd_bf16":
                assert fg_ctx.read(fg.ptr(name, layer), size) == bytes([POISON]) * size
                assert got == bytes(size), "a derived weight's room is zeroed"
            else:
                assert got == fg_ctx.read(fg.ptr(name, layer), size), (name, layer)
    full, real = fg_ctx.num_copies, os.preadv
    monkeypatch.setattr(dw.os, "preadv", lambda fd, bufs, off: 0)     # the file ends mid-read
    broken = dw.DeviceWeights(FakeContext(), plan, tmp_path, progress=False, background=True)
    with pytest.raises(ModelDirError, match="truncated"):
        broken.wait()
    gate = threading.Event()
    monkeypatch.setattr(dw.os, "preadv", lambda *a: gate.wait(5) and real(*a))
    ctx = FakeContext()
    stopped = dw.DeviceWeights(ctx, plan, tmp_path, progress=False, background=True)
    stopped._stop.set()                 # (as cancel() does, before the first piece is read)
    gate.set()
    stopped.cancel()
    assert not stopped.loading and ctx.num_copies < full and ctx.pinned_live == []


def test_broken_directories_name_the_tensor(tmp_path):
    plan = model(tmp_path, "qwen3")
    bad = dict(plan)
    bad["weights"] = {**plan["weights"]}
    wq = next(n for n in bad["weights"] if "q" in n and bad["weights"][n]["layers"] is not None)
    bad["weights"][wq] = {**bad["weights"][wq], "shape": [7, 7]}
    with pytest.raises(ModelDirError, match="expects"):
        dw.DeviceWeights(FakeContext(), bad, tmp_path, progress=False)
    shard = sorted(tmp_path.glob("*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(ModelDirError, match="truncated|not a readable"):
        dw.DeviceWeights(FakeContext(), plan, tmp_path, progress=False)


def test_derived_weights_are_allocated_not_built(tmp_path, monkeypatch):
    """A derived weight (source {"derived": ...}: the load program writes it) gets its aligned room
    past every other weight, and nothing is built on the host, read or copied for it (GPT-OSS-20B's
    resident bf16 stacks are 38 GB); the others stream as before and the bytes count it."""
    from fake_cuda import POISON
    plan = model(tmp_path, "qwen3_moe")
    base = dw.DeviceWeights(FakeContext(), plan, tmp_path, progress=False)
    stack = next(n for n, w in plan["weights"].items() if len(w["shape"]) == 3 and w["layers"])
    w = plan["weights"][stack]
    plan = {**plan, "weights": {**plan["weights"], "wd_bf16": {
        "shape": w["shape"], "dtype": "bf16", "layers": w["layers"],
        "source": {"derived": {"by": "expert_upcast", "from": [stack], "shape": w["shape"]}}}}}
    built, build = [], dw.build

    def counted(src, *a, **kw):
        built.append(src)
        return build(src, *a, **kw)
    monkeypatch.setattr(dw, "build", counted)
    ctx = FakeContext()
    got = dw.DeviceWeights(ctx, plan, tmp_path, progress=False)
    assert not any("derived" in s for s in built)
    size = 2 * int(np.prod(w["shape"]))
    assert got.bytes == base.bytes + size * len(w["layers"])
    others = max(p for n, ps in got.ptrs.items() if n != "wd_bf16" for p in (ps if isinstance(ps, list) else [ps]))
    for layer in w["layers"]:
        ptr = got.ptr("wd_bf16", layer)
        assert ptr % dw.ALIGN == 0 and ptr > others
        assert ctx.read(ptr, size) == bytes([POISON]) * size       # untouched: no copy reached it
    for name in base.ptrs:                                          # the rest as without it
        for layer in plan["weights"][name]["layers"] or [None]:
            assert got.ptr(name, layer) - got.base == base.ptr(name, layer) - base.base, name
