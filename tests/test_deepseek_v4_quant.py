"""DeepSeek-V4-Flash's weights as its checkpoint ships them (quant_method fp8, scale_fmt ue8m0,
expert_dtype fp4 beside the quantization_config; compiler/quant/formats/fp8_block.py): a tiny
float32 deepseek_v4 (tests/test_deepseek_v4.py's, experts 32 wide so that fp4's 32-column scale
groups divide every K) that tools/quantize_model.py writes as the published checkpoint does:
e4m3 linears in 8 x 8 blocks (many blocks a matrix at these widths) with e8m0 scales named
`.scale`, the routed experts fp4 (I8 [N, K/2] + e8m0 [N, K/32]), the compressor and indexer
projections and the routers bf16 and listed nowhere. The reference executor's logits at every
position equal transformers 5.23 loading the same directory (on the CPU it dequantizes every
weight as the format defines it, which the test checks against its own torch reading of the
definition, tests/quant_definitions.py), with the activations of the linears infc quantizes
quantized as the format says (per token, groups of 128 -> here 8 columns, amax / 448).
"""
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
from quantize_model import quantize_model, write_safetensors  # noqa: E402

from exhaustive import EXHAUSTIVE  # noqa: E402
from infc.compiler.build import compile_model  # noqa: E402
from infc.compiler.contract.errors import ModelDirError, SpecError  # noqa: E402
from infc.compiler.contract.safetensors_io import Checkpoint  # noqa: E402
from infc.compiler.quant.formats import parse_quantization  # noqa: E402
from infc.runtime.reference.executor import ReferenceExecutor, SeqChunk  # noqa: E402
from infc.runtime.weights.load import load_weights  # noqa: E402
from quant_definitions import WEIGHT, _acts, stored_quantized  # noqa: E402
from test_deepseek_v4 import CONFIG, _randomize, all_rows  # noqa: E402

BLOCK = (8, 8)
# what the published checkpoint keeps bf16 without a word in its config (transformers lists them
# in DeepseekV4PreTrainedModel._keep_in_fp32_modules)
PLAIN = ["compressor.wkv", "compressor.wgate", "indexer.weights_proj"]
# the HF modules of the linears infc reads as e4m3 with activations quantized (wo_a, read by the
# grouped head_linear, is dequantized at load: compiler/passes/quantize_weights.py)
ACT_QUANTIZED = ("self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_proj", "self_attn.o_b_proj",
                 "indexer.q_b_proj", "shared_experts.gate_proj", "shared_experts.up_proj",
                 "shared_experts.down_proj")
PROMPT = [int(t) for t in np.random.default_rng(5).integers(0, CONFIG["vocab_size"], 40)]


@pytest.fixture(scope="module")
def dsv4(tmp_path_factory):
    """(bf16 dir, quantized dir) of the tiny model: HCA every 16 tokens, window 8, so the 40-token
    prompt spans two HCA blocks, ten CSA blocks and five windows."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
    torch.manual_seed(47)
    cfg = dict(CONFIG, sliding_window=8, moe_intermediate_size=32,
               compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16})
    hf = DeepseekV4ForCausalLM(DeepseekV4Config(**cfg)).float().eval()
    _randomize(hf)
    root = tmp_path_factory.mktemp("dsv4q")
    hf.save_pretrained(root / "bf16")
    quantize_model(root / "bf16", root / "q", "fp8-fp4", workers=1, block=BLOCK, plain=PLAIN,
                   expert_dtype_at="top")
    return root / "bf16", root / "q"


def test_the_fixture_is_the_published_layout(dsv4):
    _, q = dsv4
    cfg = json.loads((q / "config.json").read_text())
    assert cfg["expert_dtype"] == "fp4" and "expert_dtype" not in cfg["quantization_config"]
    assert cfg["quantization_config"]["scale_fmt"] == "ue8m0" and "modules_to_not_convert" not in cfg["quantization_config"]
    ckpt = Checkpoint(q)
    e = "model.layers.2.ffn.experts.1.w2"
    assert (ckpt.dtype(f"{e}.weight"), ckpt.shape(f"{e}.weight")) == ("I8", (32, 16))
    assert (ckpt.dtype(f"{e}.scale"), ckpt.shape(f"{e}.scale")) == ("F8_E8M0", (32, 1))
    assert (ckpt.dtype("model.layers.1.attn.wq_b.weight"), ckpt.shape("model.layers.1.attn.wq_b.scale")) == ("F8_E4M3", (8, 3))
    assert ckpt.dtype("model.layers.1.attn.indexer.compressor.wkv.weight") == "F32"
    assert not any(n.endswith("weight_scale_inv") for n in ckpt.where)
    ckpt.close()


def _plan_and_logits(qdir):
    _, plan = compile_model(model_dir=str(qdir))
    ex = ReferenceExecutor(plan, load_weights(plan, Checkpoint(qdir)))
    return plan, all_rows(ex, SeqChunk(0, PROMPT, 0))


def test_reference_equals_transformers_on_the_published_format(dsv4):
    from transformers import AutoModelForCausalLM
    src, q = dsv4
    plan, got = _plan_and_logits(q)
    w = plan["weights"]
    assert w["we_gate_up"]["dtype"] == w["we_down"]["dtype"] == "e2m1"             # fp4 experts
    assert w["we_down_qscale"]["shape"] == [4, 32, 1]                               # E, N, K / 32
    assert w["wo_b"]["dtype"] == w["ws_down"]["dtype"] == w["i_q"]["dtype"] == "f8e4m3"
    assert {"e8m0": "model.layers.{i}.attn.wo_b.scale"} == w["wo_b_qscale"]["source"]
    plain = [n for n, v in w.items() if any(p.replace(".", "") in json.dumps(v["source"]).replace(".", "")
                                              for p in PLAIN)]
    assert plain and all(w[n]["dtype"] == "bf16" for n in plain)                   # read as stored
    assert w["router"]["dtype"] == "bf16" and "dequantized" in json.dumps(w["wo_a"]["source"])

    # transformers reads the directory as the format defines it: its dequantized weights equal
    # the definition computed here from the stored tensors, written back under the same names
    cfg = json.loads((q / "config.json").read_text())
    t = load_file(str(q / "model.safetensors"))
    modules = stored_quantized(t, "fp8-fp4")
    assert len(modules) > 50 and any(".experts." in m for m in modules)
    defined = {n: v for n, v in t.items() if not n.endswith(".scale")}
    for m in modules:
        defined[f"{m}.weight"] = WEIGHT["fp8-fp4"](t, m, {**cfg["quantization_config"]}).contiguous()
    d = q.parent / "defined"
    d.mkdir()
    save_file(defined, str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps({k: v for k, v in cfg.items()
                                               if k not in ("quantization_config", "expert_dtype")}))
    theirs = AutoModelForCausalLM.from_pretrained(q, dtype=torch.float32).eval()
    ours = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).state_dict()
    for name, p in theirs.state_dict().items():
        torch.testing.assert_close(p, ours[name], rtol=0, atol=0, msg=name)

    act = _acts("fp8-fp4", {}, cfg["quantization_config"], t, None)
    hooked = [mod.register_forward_pre_hook(lambda _, a: (act(a[0]),))
              for name, mod in theirs.named_modules() if name.endswith(ACT_QUANTIZED)]
    assert len(hooked) == 4 * 4 + 4 * 3 + 2                  # 4 a layer, shared 3 a layer, 2 CSA indexers
    with torch.no_grad():
        want = theirs(input_ids=torch.tensor([PROMPT]), use_cache=False).logits[0].numpy()
        base = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
        bf = base(input_ids=torch.tensor([PROMPT]), use_cache=False).logits[0].numpy()
    assert np.abs(want - bf).max() > 1e-2, "the quantization changes nothing: the test could not fail"
    err = np.abs(got - want).max(axis=1)
    assert err.max() <= 1e-4, f"worst position {int(err.argmax())}, |diff| {err.max():.2e}"


def test_fp4_experts_load_to_the_checkpoints_own_bytes(dsv4):
    """The canonical e2m1 values the loader reads, packed for the device (two a byte, the even
    column in the low nibble: the kernels' layout), are the checkpoint's I8 bytes: one layout."""
    from infc.runtime.weights.load import at
    from infc.runtime.weights.quant_pack import to_storage
    _, q = dsv4
    _, plan = compile_model(model_dir=str(q))
    weights = load_weights(plan, Checkpoint(q))
    ckpt = Checkpoint(q)
    for layer in (0, 3):
        got = to_storage(at(plan, weights, "we_down", layer), "e2m1")
        want = np.stack([np.asarray(ckpt.raw(f"model.layers.{layer}.ffn.experts.{e}.w2.weight")).view(np.uint8)
                         for e in range(4)])
        np.testing.assert_array_equal(got, want)
        scale = at(plan, weights, "we_down_qscale", layer)
        raw = np.stack([np.asarray(ckpt.raw(f"model.layers.{layer}.ffn.experts.{e}.w2.scale")) for e in range(4)])
        np.testing.assert_array_equal(scale, np.ldexp(np.float32(1), raw.astype(np.int32) - 127))
    ckpt.close()


def test_transformers_spelling_and_config_placement_read_alike(dsv4, tmp_path):
    """`weight_scale_inv` (transformers' name) and expert_dtype inside quantization_config read
    the same plan sources but the scale names, and the same logits."""
    src, q = dsv4
    quantize_model(src, tmp_path, "fp8-fp4", workers=1, block=BLOCK, plain=PLAIN, scale_name="weight_scale_inv")
    plan, got = _plan_and_logits(tmp_path)
    plan0, want = _plan_and_logits(q)
    assert plan["weights"]["we_down_qscale"]["source"] == {
        "stack": {"e8m0": "model.layers.{i}.ffn.experts.{e}.w2.weight_scale_inv"}, "count": 4}
    assert json.dumps({n: v["source"] for n, v in plan["weights"].items()}).replace(".weight_scale_inv", ".scale") \
        == json.dumps({n: v["source"] for n, v in plan0["weights"].items()})
    np.testing.assert_array_equal(got, want)


def _damaged(q, tmp_path, name, damage):
    out = tmp_path / "bad"
    out.mkdir()
    for f in q.iterdir():
        if f.name != "model.safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    ckpt = Checkpoint(q)
    tensors = {n: (ckpt.dtype(n), np.array(ckpt.raw(n))) for n in ckpt.where}
    ckpt.close()
    got = damage(*tensors[name]) if name in tensors else None
    if got is None:
        del tensors[name]
    else:
        tensors[name] = got
    write_safetensors(out / "model.safetensors", tensors)
    return out


E = "model.layers.3.ffn.experts.2"
S = "model.layers.0.attn.wq_a"


@pytest.mark.parametrize("name,damage,says", [
    (f"{E}.w1.weight", lambda dt, a: ("U8", a.view(np.uint8)), "U8"),
    pytest.param(f"{E}.w3.weight", lambda dt, a: (dt, np.concatenate([a, a], 1)), "shape", marks=EXHAUSTIVE),
    pytest.param(f"{E}.w2.scale", lambda dt, a: ("F32", np.ldexp(np.float32(1), a.astype(np.int32) - 127)), "F32",
                 marks=EXHAUSTIVE),
    (f"{S}.scale", lambda dt, a: (dt, np.ascontiguousarray(a[:, :-1])), "shape"),
    (f"{S}.weight", lambda dt, a: ("BF16", np.zeros(a.shape, np.uint16)), "BF16"),
], ids=["fp4-codes-u8", "fp4-codes-unpacked", "fp4-scale-f32", "fp8-scale-blocks", "bf16-weight-with-scale"])
def test_damaged_tensor_fails_naming_it(dsv4, tmp_path, name, damage, says):
    bad = _damaged(dsv4[1], tmp_path, name, damage)
    with pytest.raises((SpecError, ModelDirError)) as e:          # checkpoint honesty, from the headers
        compile_model(model_dir=str(bad))
    assert f"'{name}'" in str(e.value) and says in str(e.value), str(e.value)


def test_expert_dtype_read_beside_or_in_the_config_and_checked():
    q = {"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"}
    fmt = parse_quantization({"quantization_config": q, "expert_dtype": "fp4"}, "config.json")
    assert str(fmt.expert_scheme_for("m.experts.0.w1")).startswith("e2m1 [1x32]")
    assert str(fmt.scheme_for("m.experts.0.w1")).startswith("f8e4m3 [128x128]")
    assert str(parse_quantization({"quantization_config": q}, "c").expert_scheme_for("x")).startswith("f8e4m3")
    with pytest.raises(ModelDirError, match="config.json: expert_dtype 'fp2'"):
        parse_quantization({"quantization_config": q, "expert_dtype": "fp2"}, "config.json")
    with pytest.raises(ModelDirError, match="disagree"):
        parse_quantization({"quantization_config": {**q, "expert_dtype": "fp8"}, "expert_dtype": "fp4"}, "c")


def test_flash_plan_reads_fp4_experts_and_fp8_linears():
    """The committed deepseek-v4-flash plan (the variant binds the published quantization_config):
    the routed experts e2m1 with a scale a row and 32 columns, the linears e4m3 in 128 x 128
    blocks, and inspect's bytes a weight for each (f32 scales on the device: 0.5 + 4 / 32)."""
    from infc.compiler.build import GENERATED
    from infc.compiler.quant.report import weights_section
    plan = json.loads((GENERATED / "deepseek-v4-flash" / "plan.json").read_text())
    w = plan["weights"]
    assert w["we_down"]["dtype"] == w["we_gate_up"]["dtype"] == "e2m1"
    assert w["we_down"]["shape"] == [256, 4096, 2048] and w["we_down_qscale"]["shape"] == [256, 4096, 64]
    assert w["wq_b"]["dtype"] == "f8e4m3" and w["wq_b_qscale"]["shape"] == [256, 8]
    rows = [r for r in weights_section(plan, ["decode"]) if r.lstrip().startswith(("moe_", "linear"))]
    assert sum("e2m1 [1x32]" in r and "(6 of 256 experts, 0.625 B a weight)" in r for r in rows) == 2, rows
    assert all("1.000 B a weight" in r for r in rows if "f8e4m3 [128x128]" in r)


@EXHAUSTIVE
def test_flash_per_rank_memory_at_dp8_ep8():
    """`infc inspect deepseek-v4-flash -dp 8 --enable-expert-parallel`: a rank holds 32 experts
    of each layer in fp4; its weights and the 128k sequences an H200 holds beside them."""
    import re
    from infc.compiler.inspect import inspect
    out = inspect("deepseek-v4-flash", enable_expert_parallel=True, data_parallel_size=8, rank=0,
                  phases=["decode"])
    assert "(6 of 32 experts, 0.625 B a weight)" in out
    gib, fit = re.search(r"H200 \(140.4 GiB\): weights ([\d.]+) GiB .* (\d+) sequences fit", out).groups()
    assert 25 < float(gib) < 32 and int(fit) >= 12, out[-2000:]


@EXHAUSTIVE
def test_interpreted_fp4_expert_kernels_equal_bf16_kernels_on_the_definition(dsv4, tmp_path):
    """The fp4 routed experts through their generated Triton kernels under the interpreter (e2m1
    codes, DeepSeek-V4's clamped SwiGLU; prefill chunks and decode steps), the other linears bf16, against the same model stored bf16 with the
    experts' weights dequantized by the definition: the two plans' kernels give the same logits
    (e2m1 x 2^e is exact in bf16), and each its reference's within this model's bf16 noise
    (measured 1.6e-2 / 3.1e-2 relative on the two chunks, alike for both).
    EXHAUSTIVE: minutes of CPU (the compressor and indexer kernels loop a token at a time)."""
    from infc.compiler.build import build
    from infc.runtime.engine.step import Chunk
    from interp_executor import InterpExecutor
    dense = ["attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_a", "attn.wo_b", "indexer.wq_b",
             "shared_experts.w1", "shared_experts.w2", "shared_experts.w3"]
    src, q = dsv4[0], tmp_path / "experts"
    quantize_model(src, q, "fp8-fp4", workers=1, block=BLOCK, plain=PLAIN + dense, expert_dtype_at="top")
    cfg = json.loads((q / "config.json").read_text())
    t = load_file(str(q / "model.safetensors"))
    defined = {n: v for n, v in t.items() if not n.endswith(".scale")}
    for m in stored_quantized(t, "fp8-fp4"):
        defined[f"{m}.weight"] = WEIGHT["fp8-fp4"](t, m, cfg["quantization_config"]).contiguous()
    d = tmp_path / "defined"
    d.mkdir()
    save_file(defined, str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps({k: v for k, v in cfg.items()
                                               if k not in ("quantization_config", "expert_dtype")}))
    runs = []
    for model in (q, d):
        out = build(model_dir=str(model), out=tmp_path / f"art-{model.name}", compile=False, log=None, page_size=16)
        plan = json.loads((out / "plan.json").read_text())
        plan["_dir"] = str(out)
        plan["short_tokens"] = 16                # the 19- and 21-token chunks on the prefill program
        weights = load_weights(plan, Checkpoint(model))
        ex, ref = InterpExecutor(plan, weights, page_size=16), ReferenceExecutor(plan, weights)
        steps, n, tok = [], len(PROMPT), None
        for chunk in (Chunk(0, PROMPT[:21], 0), Chunk(0, PROMPT[21:], 21)):
            steps.append((ex.step([chunk]), ref.step([chunk])))
        for _ in range(2):                                       # decode steps: the expert GEMVs
            tok = int(np.argmax(steps[-1][1]))
            steps.append((ex.step([Chunk(0, [tok], n)]), ref.step([Chunk(0, [tok], n)])))
            n += 1
        runs.append((plan, ex.templates, steps))
    (plan, templates, fp4), (plain, _, bf16) = runs
    assert plan["weights"]["we_down"]["dtype"] == "e2m1" and plain["weights"]["we_down"]["dtype"] == "bf16"
    # (this tiny plan's prefill takes the per-expert kernels too: 4 experts; MXFP4's tests take
    # the grouped ones with e2m1 codes)
    assert {"moe_gate_up", "moe_down"} <= {t for op, t in templates if op in ("moe_gate_up", "moe_down")}
    for (got, want), (got0, want0) in zip(fp4, bf16):
        np.testing.assert_allclose(want, want0, atol=1e-5, rtol=0)            # the references agree
        assert np.linalg.norm(got - got0) / np.linalg.norm(got0) < 1e-3       # so do the kernels
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 5e-2


def test_fused_fp8_plan_reads_its_part_views_where_they_are(dsv4, tmp_path):
    """With fp8 activation codes in the plan (act groups of 16: compiler/passes/act_codes.py) the
    reference's arena gives every element 4 bytes; a column slice inside another buffer (the
    shared experts' gate|up halves) must be found by its plan elements, not its plan bytes times
    4 (which read the up half past the row: NaN). Fused equals --no-fuse."""
    src, q = dsv4[0], tmp_path / "q16"
    quantize_model(src, q, "fp8-fp4", workers=1, block=(16, 16), plain=PLAIN, expert_dtype_at="top")
    rows = []
    for fuse in (True, False):
        _, plan = compile_model(model_dir=str(q), fuse=fuse)
        if fuse:
            assert any(b.get("row_stride") for b in plan["buffers"].values())
            assert any(b["dtype"] == "f8e4m3" for b in plan["buffers"].values())
        rows.append(all_rows(ReferenceExecutor(plan, load_weights(plan, Checkpoint(q))), SeqChunk(0, PROMPT[:12], 0)))
    assert np.isfinite(rows[0]).all()
    np.testing.assert_allclose(rows[0], rows[1], atol=2e-5, rtol=0)
