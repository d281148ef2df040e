"""Every published quantization format infc reads (compiler/quant/formats/), on a tiny qwen3 that
tools/quantize_model.py writes in the format: the reference executor's logits for a 12-token
prompt equal an independent computation of the format's definition, the HF float32 model whose
quantized linears hold the weights dequantized HERE (torch, or the format's own library:
compressed-tensors' decompressor, transformers' MXFP4 converter) from the stored tensors, with
activations quantized as the format says.

Hidden 128 / intermediate 256 so that groups of 32, 64 and 128 divide every K.
"""
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
from quantize_model import quantize_model  # noqa: E402

from exhaustive import EXHAUSTIVE  # noqa: E402
from infc.compiler.build import compile_model  # noqa: E402
from infc.compiler.contract.safetensors_io import Checkpoint  # noqa: E402
from infc.runtime.reference.executor import ReferenceExecutor, SeqChunk  # noqa: E402
from infc.runtime.weights.load import load_weights  # noqa: E402

PROMPT = [5, 17, 3, 250, 91, 42, 7, 300, 12, 64, 128, 9]
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")

# id -> (writer, options): every format, group sizes 32/64/128, symmetric and asymmetric,
# act-order, int4 and int8, per-tensor / per-channel / block fp8 with dynamic and static activations.
# The fast suite runs one case of each format family and each axis; SLOW ones run in `make test-all`.
CASES = {
    "fp8-block": ("fp8-block", dict(block=(32, 64))),
    "fp8-tensor-static": ("fp8-tensor", dict(act="static")),
    "ct-fp8-channel-dynamic": ("ct-fp8", dict(strategy="channel", act="dynamic")),
    "ct-fp8-tensor-static": ("ct-fp8", dict(strategy="tensor", act="static")),
    "ct-fp8-block-group": ("ct-fp8", dict(strategy="block", block=(64, 32), act="group")),
    "ct-w4a16-g128-sym": ("ct-int", dict(bits=4, group=128, sym=True)),
    "ct-w4a16-g32-asym": ("ct-int", dict(bits=4, group=32, sym=False)),
    "ct-w8a16-channel-asym": ("ct-int", dict(bits=8, group=None, sym=False)),
    "ct-w4a16-g64-actorder": ("ct-int", dict(bits=4, group=64, act_order=True)),
    "ct-w8-naive-g64": ("ct-int", dict(bits=8, group=64, format="naive-quantized")),
    "awq-g64": ("awq", dict(group=64)),
    "gptq-int4-g128-sym-v1": ("gptq", dict(bits=4, group=128, sym=True)),
    "gptq-int4-g32-asym-actorder-v1": ("gptq", dict(bits=4, group=32, sym=False, desc_act=True)),
    "gptq-int8-channel-asym-v2": ("gptq", dict(bits=8, group=-1, sym=False, checkpoint_format="gptq_v2")),
    "mxfp4": ("mxfp4", {}),
    # ignore lists: a regex (compressed-tensors), a suffix (modules_to_not_convert) stay bf16
    "ct-w4a16-g32-keep-down": ("ct-int", dict(bits=4, group=32, keep=["mlp.down_proj"])),
    "gptq-int4-g64-keep-o": ("gptq", dict(bits=4, group=64, keep=["self_attn.o_proj"])),
}
SLOW = {"ct-fp8-block-group", "gptq-int4-g64-keep-o", "fp8-block", "ct-fp8-tensor-static", "ct-w4a16-g128-sym", "ct-w8-naive-g64",
        "gptq-int4-g128-sym-v1"}


from quant_definitions import WEIGHT, _acts  # noqa: E402  (the formats' definitions; test_quant_moe imports them from here)


def definition_logits(model, qdir: Path, writer: str, o: dict) -> np.ndarray:
    """The HF float32 model computing the format's definition: quantized linears' weights
    dequantized from qdir's tensors, their inputs quantized as the format does."""
    cfg = json.loads((qdir / "config.json").read_text())["quantization_config"]
    t = load_file(str(qdir / "model.safetensors"))
    saved, hooks = {}, []
    try:
        for i, layer in enumerate(model.model.layers):
            for name in LINEARS:
                mod = layer.get_submodule(name)
                m = f"model.layers.{i}.{name}"
                saved[m] = mod.weight.data.clone()
                if any(name.endswith(k) for k in o.get("keep", [])):
                    continue                                # left unquantized
                mod.weight.data = WEIGHT[writer](t, m, cfg).to(torch.float32).contiguous()
                act = _acts(writer, o, cfg, t, m)
                if act is not None:
                    hooks.append(mod.register_forward_pre_hook(lambda _, a, f=act: (f(a[0]),)))
        with torch.no_grad():
            return model(torch.tensor([PROMPT])).logits[0, -1].numpy()
    finally:
        for h in hooks:
            h.remove()
        for i, layer in enumerate(model.model.layers):
            for name in LINEARS:
                layer.get_submodule(name).weight.data = saved[f"model.layers.{i}.{name}"]


def infc_logits(qdir: Path, prompt=PROMPT):
    """(the reference executor's last logits for the prompt, the plan) of a model directory."""
    _, plan = compile_model(model_dir=qdir)
    ex = ReferenceExecutor(plan, load_weights(plan, Checkpoint(qdir)))
    return np.asarray(ex.step([SeqChunk(0, prompt, 0)])[0]), plan


@pytest.fixture(scope="module")
def base(tiny_model):
    """(model dir, HF float32 model, its logits)."""
    d, model = tiny_model("qwen3", hidden_size=128, intermediate_size=256, head_dim=32, num_hidden_layers=2)
    with torch.no_grad():
        return d, model, model(torch.tensor([PROMPT])).logits[0, -1].numpy()


@pytest.fixture(scope="module")
def quantized(base, tmp_path_factory):
    """case -> (its checkpoint directory, the reference executor's logits, the plan), once each."""
    cache = {}

    def get(case):
        if case not in cache:
            writer, o = CASES[case]
            d = tmp_path_factory.mktemp(case)
            quantize_model(base[0], d, writer, **o)
            cache[case] = (d, *infc_logits(d))
        return cache[case]
    return get


@pytest.mark.parametrize("case", [pytest.param(c, marks=[EXHAUSTIVE] if c in SLOW else []) for c in CASES])
def test_reference_equals_the_format_definition(case, base, quantized):
    writer, o = CASES[case]
    src, model, bf = base
    qdir, got, plan = quantized(case)
    quantized = json.dumps([w["source"] for w in plan["weights"].values()
                            if w["dtype"] in ("f8e4m3", "u4", "u8", "e2m1")])
    kept = o.get("keep", [])
    assert all((f"{{i}}.{m}." in quantized) != (m in kept) for m in LINEARS), \
        f"{case}: the linears read quantized are not those the checkpoint quantizes"
    want = definition_logits(model, qdir, writer, o)
    assert np.abs(want - bf).max() > 1e-3, f"{case}: the quantization changes nothing: the test could not fail"
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0, err_msg=case)


# transformers (with compressed-tensors) loads these on the CPU and computes their definition
# (asymmetric and act-order compressed-tensors checkpoints it does not load: zero points are
# declared unpacked, actorder "group" is refused)
HF_LOADS = ["ct-fp8-channel-dynamic", "ct-fp8-tensor-static", "ct-w4a16-g128-sym", "ct-fp8-block-group"]


@pytest.mark.parametrize("case", [pytest.param(c, marks=[] if i == 0 else [EXHAUSTIVE])
                                  for i, c in enumerate(HF_LOADS)])
def test_reference_equals_transformers(case, quantized):
    from transformers import AutoModelForCausalLM
    qdir, got, _ = quantized(case)
    hf = AutoModelForCausalLM.from_pretrained(qdir, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(torch.tensor([PROMPT])).logits[0, -1].float().numpy()
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0, err_msg=case)


@pytest.mark.parametrize("bits,group,sym", [(4, 32, True), (4, 64, False), (8, None, False), (4, None, False),
                                            (8, 128, True)])
def test_pack_quantized_writer_is_compressed_tensors_compressor(bits, group, sym):
    """The fixture writer's pack-quantized tensors are byte for byte what compressed-tensors'
    compressor writes from the same weight, scales and zero points; per channel K = 100 (4-bit rows
    end in a partial word), and N = 36 (4-bit zero points end in a partial word along N)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from quantize_model import CONFIGS, WRITERS
    o = dict(bits=bits, group=group, sym=sym)
    w = np.random.default_rng(bits).standard_normal((36, 3 * group if group else 100)).astype(np.float32)
    ours = WRITERS["ct-int"]("m", w, o)
    group_cfg = CONFIGS["ct-int"](o)["config_groups"]["group_0"]
    scheme = QuantizationScheme(**{k: v for k, v in group_cfg.items() if k != "format"})
    state = {"weight": torch.from_numpy(w), "weight_scale": torch.from_numpy(ours["m.weight_scale"][1])}
    if not sym:
        from compressed_tensors.compressors.pack_quantized import unpack_from_int32
        zp = unpack_from_int32(torch.from_numpy(ours["m.weight_zero_point"][1]), bits,
                               torch.Size([36, ours["m.weight_scale"][1].shape[1]]), packed_dim=0)
        state["weight_zero_point"] = zp
    theirs = BaseCompressor.load_from_registry("pack-quantized").compress(state, scheme)
    np.testing.assert_array_equal(ours["m.weight_packed"][1], theirs["weight_packed"].numpy())
    if not sym:
        np.testing.assert_array_equal(ours["m.weight_zero_point"][1], theirs["weight_zero_point"].numpy())
