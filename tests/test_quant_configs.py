"""A malformed `quantization_config` fails the build naming the key (compiler/quant/formats/,
compiler/quant/config_keys.py): `config.json: quantization_config.<key path>: why`."""
import copy
import json
import sys
from pathlib import Path

import pytest

from infc.compiler.contract.errors import ModelDirError
from infc.compiler.quant.formats import parse_quantization

from test_checkpoint_honesty import build_dir, tiny_shapes, write_model

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
from quantize_model import CONFIGS, quantize_model  # noqa: E402

W4 = CONFIGS["ct-int"](dict(bits=4, group=32, sym=False))
FP8 = CONFIGS["ct-fp8"](dict(strategy="channel", act="dynamic"))
G0 = "quantization_config.config_groups.group_0"


def _with(base: dict, path: str, value, drop=False) -> dict:
    """base with the dotted key path set to value (or removed)."""
    q = copy.deepcopy(base)
    *head, last = path.split(".")
    d = q
    for k in head:
        d = d[k]
    if drop:
        del d[last]
    else:
        d[last] = value
    return q


def ct(path, value, base=W4, drop=False):
    return _with(base, path.replace(G0[len("quantization_config."):], "config_groups.group_0"), value, drop)


# (id, quantization_config, the key the error must name)
CASES = [
    ("not-an-object", ["fp8"], "quantization_config"),
    ("unknown-method", {"quant_method": "bitsandbytes"}, "quantization_config.quant_method"),
    ("fp8-block-shape", dict(CONFIGS["fp8-block"]({}), weight_block_size=[128]),
     "quantization_config.weight_block_size"),
    ("fp8-static-blocks", dict(CONFIGS["fp8-block"]({}), activation_scheme="static"),
     "quantization_config.activation_scheme"),
    ("ct-group-size-zero", ct("config_groups.group_0.weights.group_size", 0), f"{G0}.weights.group_size"),
    ("ct-group-without-size", ct("config_groups.group_0.weights.group_size", None, drop=True),
     f"{G0}.weights.group_size"),
    ("ct-3-bits", ct("config_groups.group_0.weights.num_bits", 3), f"{G0}.weights.num_bits"),
    ("ct-format", ct("config_groups.group_0.format", "marlin-24"), f"{G0}.format"),
    ("ct-fp8-packed", ct("config_groups.group_0.format", "pack-quantized", base=FP8), f"{G0}.format"),
    ("ct-status", ct("quantization_status", "frozen"), "quantization_config.quantization_status"),
    ("ct-int8-activations", ct("config_groups.group_0.input_activations.type", "int", base=FP8),
     f"{G0}.input_activations.type"),
    ("ct-static-per-token", ct("config_groups.group_0.input_activations.dynamic", False, base=FP8),
     f"{G0}.input_activations.strategy"),
    ("ct-unknown-weights-key", ct("config_groups.group_0.weights.bogus", 1), f"{G0}.weights.bogus"),
    ("ct-bad-ignore-regex", ct("ignore", ["re:model.layers.[0"]), "quantization_config.ignore"),
    ("ct-no-targets", ct("config_groups.group_0.targets", []), f"{G0}.targets"),
    ("ct-asym-per-tensor", ct("config_groups.group_0.weights.strategy", "tensor",
                              base=CONFIGS["ct-int"](dict(bits=8, sym=False))), f"{G0}.weights.symmetric"),
    ("ct-no-groups", ct("config_groups", {}), "quantization_config.config_groups"),
    ("awq-gemv", dict(CONFIGS["awq"]({}), version="gemv"), "quantization_config.version"),
    ("awq-8-bits", dict(CONFIGS["awq"]({}), bits=8), "quantization_config.bits"),
    ("awq-no-zero-point", dict(CONFIGS["awq"]({}), zero_point=False), "quantization_config.zero_point"),
    ("gptq-3-bits", dict(CONFIGS["gptq"]({}), bits=3), "quantization_config.bits"),
    ("gptq-format", dict(CONFIGS["gptq"]({}), checkpoint_format="marlin"), "quantization_config.checkpoint_format"),
    ("gptq-desc-act-string", dict(CONFIGS["gptq"]({}), desc_act="yes"), "quantization_config.desc_act"),
    ("gptq-group-zero", dict(CONFIGS["gptq"]({}), group_size=0), "quantization_config.group_size"),
    ("gptq-marlin", dict(CONFIGS["gptq"]({}), is_marlin_format=True), "quantization_config.is_marlin_format"),
    ("gptq-unknown-key", dict(CONFIGS["gptq"]({}), bogus=True), "quantization_config.bogus"),
    ("fp8-scale-fmt", dict(CONFIGS["fp8-fp4"]({}), scale_fmt="e8m0"), "quantization_config.scale_fmt"),
    ("fp8-expert-dtype", dict(CONFIGS["fp8-fp4"]({}), expert_dtype="nvfp4"), "quantization_config.expert_dtype"),
    ("fp8-ue8m0-per-tensor", {"quant_method": "fp8", "scale_fmt": "ue8m0"}, "quantization_config.scale_fmt"),
    ("mxfp4-skip-string", dict(CONFIGS["mxfp4"]({}), modules_to_not_convert="lm_head"),
     "quantization_config.modules_to_not_convert"),
    ("mxfp4-dequantize", dict(CONFIGS["mxfp4"]({}), dequantize=True), "quantization_config.dequantize"),
]


@pytest.mark.parametrize("q,key", [pytest.param(q, k, id=i) for i, q, k in CASES])
def test_malformed_quantization_config_names_the_key(q, key):
    with pytest.raises(ModelDirError) as e:
        parse_quantization({"quantization_config": q}, "config.json")
    assert f"config.json: {key}:" in str(e.value) or f"config.json: {key} " in str(e.value), str(e.value)


def test_published_configs_parse():
    """The writers' configs (as the formats publish them) are read without complaint."""
    for fmt, o in [("ct-int", {}), ("ct-fp8", {}), ("awq", {}), ("gptq", {}), ("mxfp4", {}),
                   ("fp8-block", {}), ("fp8-tensor", {"act": "static"}), ("fp8-fp4", {})]:
        assert parse_quantization({"quantization_config": CONFIGS[fmt](o)}, "config.json") is not None


def test_fp8_fmt_read_in_both_spellings():
    """`fmt: float8_e4m3fn` (torch's name, MiniMax-M2's config.json) is the same e4m3 format as
    `fmt: e4m3`; another value still fails naming the key."""
    block = CONFIGS["fp8-block"]({})
    a = parse_quantization({"quantization_config": block}, "config.json")
    b = parse_quantization({"quantization_config": dict(block, fmt="float8_e4m3fn")}, "config.json")
    assert vars(a) == vars(b)
    with pytest.raises(ModelDirError, match="quantization_config.fmt"):
        parse_quantization({"quantization_config": dict(block, fmt="float8_e5m2")}, "config.json")


def test_build_fails_naming_the_key(capsys, monkeypatch, tmp_path):
    """Through `infc build`: exit 2, `error: .../config.json: quantization_config...`, no traceback."""
    src = write_model(tmp_path / "m", tiny_shapes())
    q = tmp_path / "q"
    quantize_model(src, q, "ct-int", bits=4, group=32)
    cfg = json.loads((q / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = -32
    (q / "config.json").write_text(json.dumps(cfg))
    rc, out, err = build_dir(capsys, monkeypatch, tmp_path, q)
    assert rc == 2 and err.startswith("error: "), err
    assert f"config.json: {G0}.weights.group_size: -32" in err, err


def test_writer_refuses_options_its_format_cannot_hold(tmp_path):
    """tools/quantize_model.py checks its config with the reader before writing a byte."""
    with pytest.raises(ModelDirError, match="quantization_config.bits: 3"):
        quantize_model(tmp_path / "absent", tmp_path / "q", "gptq", bits=3)
    with pytest.raises(ValueError, match="unknown option"):
        quantize_model(tmp_path / "absent", tmp_path / "q", "awq", bits=4)
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize("qc,head_quantized", [
    ({"quant_method": "fp8", "weight_block_size": [16, 16]}, False),           # DeepSeek-V3's: no ignore list
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
      "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float",
                              "strategy": "channel", "symmetric": True, "dynamic": False}}}}, True),
])
def test_the_output_head_stays_bf16_where_transformers_never_converts_it(tmp_path, qc, head_quantized):
    """transformers' fp8 / AWQ / GPTQ / MXFP4 quantizers never convert the output embeddings, so a
    config naming no ignore list still means a bf16 lm_head (a config-only build counted DeepSeek-V3's
    and Kimi-K2's as FP8); compressed-tensors quantizes whatever its targets match and its ignore
    list leaves."""
    from infc.compiler.build import compile_model
    from test_dummy_weights import config_only
    d = config_only(tmp_path / "m", tie_word_embeddings=False, quantization_config=qc)
    _, plan = compile_model(model_dir=str(d), check_checkpoint=False)
    head = plan["weights"]["lm_head"]
    assert (head["dtype"] != "bf16") == head_quantized, head
    assert any(w["dtype"] != "bf16" for n, w in plan["weights"].items() if n != "lm_head")
