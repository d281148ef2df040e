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


# ------------------------------------------------ the formats' definitions, from the stored tensors
def _bits(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> the b-bit fields they hold along dim, field i of a word at bits b*i."""
    mask, per = (1 << bits) - 1, 32 // bits
    fields = [(words >> (bits * i)) & mask for i in range(per)]
    return torch.stack(fields, dim + 1).flatten(dim, dim + 1)


def _fp8_weight(t, m, cfg):
    w = t[f"{m}.weight"].float()
    s = t[f"{m}.weight_scale_inv"].float()
    if s.numel() == 1:
        return w * s.reshape(())
    bn, bk = cfg["weight_block_size"]
    return w * s.repeat_interleave(bn, 0)[:w.shape[0]].repeat_interleave(bk, 1)[:, :w.shape[1]]


def _ct_weight(t, m, cfg):
    """compressed-tensors' own decompressor on the module's stored tensors (act-order "group",
    which compressed-tensors 0.20 no longer reads but published checkpoints hold: by the
    definition here, as vLLM reads it: column k in group weight_g_idx[k])."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme
    group = cfg["config_groups"]["group_0"]
    state = {k[len(m) + 1:]: v for k, v in t.items() if k.startswith(m + ".")}
    if group["weights"].get("actorder") == "group":    # published before compressed-tensors dropped it
        bits, n = group["weights"]["num_bits"], state["weight_shape"][0]
        q = _bits(state["weight_packed"], bits, 1)[:, :state["weight_shape"][1]].float()
        g = state["weight_g_idx"].long()
        return (q - (1 << (bits - 1))) * state["weight_scale"].float()[:, g][:n]
    scheme = QuantizationScheme(**{k: v for k, v in group.items() if k != "format"})
    if "weight_shape" not in state:
        state["weight_shape"] = torch.tensor(state["weight"].shape)
    return BaseCompressor.load_from_registry(group["format"]).decompress(state, scheme)["weight"].float()


def _awq_weight(t, m, cfg):
    g = cfg["group_size"]
    # AutoAWQ's unpack: the 8 nibbles of a word in order, then its reverse order [0, 4, 1, 5, 2, 6, 3, 7]
    rev = torch.arange(t[f"{m}.scales"].shape[1]).view(-1, 8)[:, [0, 4, 1, 5, 2, 6, 3, 7]].flatten()
    q = _bits(t[f"{m}.qweight"], 4, 1)[:, rev].float()
    z = _bits(t[f"{m}.qzeros"], 4, 1)[:, rev].float()
    s = t[f"{m}.scales"].float()
    return ((q - z.repeat_interleave(g, 0)) * s.repeat_interleave(g, 0)).T


def _gptq_weight(t, m, cfg):
    bits = cfg["bits"]
    q = _bits(t[f"{m}.qweight"], bits, 0).float()                     # [K, N]
    z = _bits(t[f"{m}.qzeros"], bits, 1).float()[:, :q.shape[1]]     # [G, N]
    if cfg["checkpoint_format"] == "gptq":
        z = z + 1
    g = t[f"{m}.g_idx"].long()
    if cfg["group_size"] != -1 and not cfg["desc_act"]:
        g = torch.arange(q.shape[0]) // cfg["group_size"]
    return ((q - z[g]) * t[f"{m}.scales"].float()[g]).T


def _mxfp4_weight(t, m, cfg):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    w = convert_moe_packed_tensors(t[f"{m}.weight_blocks"][None], t[f"{m}.weight_scales"][None],
                                   dtype=torch.float32)
    return w[0].T


def _e4m3(x: torch.Tensor, s) -> torch.Tensor:
    return (x / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s


def _acts(writer, o, cfg, t, m):
    """The activation quantizer the format applies to the module's input (None: weight-only)."""
    if writer == "fp8-block" or o.get("act") == "group":
        bk = cfg["weight_block_size"][1] if writer == "fp8-block" else \
            cfg["config_groups"]["group_0"]["input_activations"]["group_size"]

        def group(x):
            xg = x.unflatten(-1, (-1, bk))
            s = xg.abs().amax(-1, keepdim=True) / 448
            return _e4m3(xg, torch.where(s > 0, s, 1)).flatten(-2)
        return group
    act = o.get("act", "dynamic")
    if writer in ("fp8-tensor", "ct-fp8") and act == "static":
        s = t[f"{m}.input_scale"].float().reshape(())
        return lambda x: _e4m3(x, s)
    if writer in ("fp8-tensor", "ct-fp8") and act == "dynamic":
        def token(x):
            s = x.abs().amax(-1, keepdim=True) / 448
            return _e4m3(x, torch.where(s > 0, s, 1))
        return token
    return None


WEIGHT = {"fp8-block": _fp8_weight, "fp8-tensor": _fp8_weight, "ct-fp8": _ct_weight,
          "ct-int": _ct_weight, "awq": _awq_weight, "gptq": _gptq_weight, "mxfp4": _mxfp4_weight}


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
