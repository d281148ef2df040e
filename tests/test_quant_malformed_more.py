"""More malformed or inconsistent quantized checkpoints (beside tests/test_quant_configs.py's
configs and tests/test_quant_honesty.py's damaged tensors): each fails the build with an error
naming the key or the tensor, never a Python exception of infc's own (a TypeError from a list
quant_method, an OverflowError from a group size past int64 at the first step) nor a silent
misread (GPTQModel's per-module overrides, two qzeros layouts named at once, compressed-tensors'
more specific target losing to `Linear`)."""
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from infc.compiler.contract.errors import ModelDirError
from infc.compiler.contract.safetensors_io import Checkpoint
from infc.compiler.quant.formats import parse_quantization

from test_checkpoint_honesty import build_dir, tiny_shapes, write_model
from test_quant_configs import W4, ct

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
from quantize_model import CONFIGS, quantize_model, write_safetensors  # noqa: E402

HUGE = 10**20           # past int64: numpy's k // group_size overflowed at the first step
G0 = "quantization_config.config_groups.group_0"

# (id, quantization_config, the key the error must name, what it says)
CASES = [
    ("method-list", {"quant_method": ["fp8"]}, "quantization_config.quant_method", "must be a string"),
    ("method-object", {"quant_method": {"name": "fp8"}}, "quantization_config.quant_method", "must be a string"),
    ("method-missing", {"weight_block_size": [128, 128]}, "quantization_config.quant_method", "missing"),
    ("method-uppercase", dict(CONFIGS["fp8-block"]({}), quant_method="FP8"), "quantization_config.quant_method",
     "did you mean 'fp8'"),
    ("fp8-block-huge", dict(CONFIGS["fp8-block"]({}), weight_block_size=[2**62, 2**62]),
     "quantization_config.weight_block_size", "at most"),
    ("awq-group-huge", dict(CONFIGS["awq"]({}), group_size=HUGE), "quantization_config.group_size", "too large"),
    ("gptq-group-huge", dict(CONFIGS["gptq"]({}), group_size=HUGE), "quantization_config.group_size", "too large"),
    ("ct-group-huge", ct("config_groups.group_0.weights.group_size", HUGE), f"{G0}.weights.group_size", "too large"),
    ("ct-block-huge", ct("config_groups.group_0.weights.block_structure", [HUGE, 128],
                         base=CONFIGS["ct-fp8"](dict(strategy="block", block=(128, 128), act="group"))),
     f"{G0}.weights.block_structure", "at most"),
    ("fp8-skip-empty-string", dict(CONFIGS["fp8-block"]({}), modules_to_not_convert=""),
     "quantization_config.modules_to_not_convert", "must be a list"),
    ("awq-skip-false", dict(CONFIGS["awq"]({}), modules_to_not_convert=False),
     "quantization_config.modules_to_not_convert", "must be a list"),
    ("gptq-dynamic-skip", dict(CONFIGS["gptq"]({}), dynamic={"-:.*down_proj": {}}), "quantization_config.dynamic",
     "not read"),
    ("gptq-dynamic-override", dict(CONFIGS["gptq"]({}), dynamic={"+:.*q_proj": {"bits": 8}}),
     "quantization_config.dynamic", "not read"),
    ("gptq-formats-disagree", dict(CONFIGS["gptq"]({}), format="gptq_v2"), "quantization_config.format", "disagree"),
    ("gptq-format-beside-list", dict(CONFIGS["gptq"]({}), format=["gptq"]), "quantization_config.format",
     "layouts read"),
    ("ct-kv-scheme-list", ct("kv_cache_scheme", [8]), "quantization_config.kv_cache_scheme", "must be an object"),
]


@pytest.mark.parametrize("q,key,says", [pytest.param(q, k, s, id=i) for i, q, k, s in CASES])
def test_malformed_config_names_the_key(q, key, says):
    with pytest.raises(ModelDirError) as e:
        parse_quantization({"quantization_config": q}, "config.json")
    msg = str(e.value)
    assert (f"config.json: {key}:" in msg or f"config.json: {key} " in msg) and says in msg, msg


@pytest.mark.parametrize("q", [
    dict(CONFIGS["gptq"]({}), dynamic={}), dict(CONFIGS["gptq"]({}), dynamic=None),
    dict(CONFIGS["gptq"]({}), format="GPTQ"),                      # the same layout, named twice
    {k: v for k, v in CONFIGS["gptq"]({}).items() if k != "checkpoint_format"} | {"format": "gptq_v2"},
    dict(CONFIGS["fp8-block"]({}), weight_block_size=[2**31 - 1, 128], modules_to_not_convert=None),
    ct("kv_cache_scheme", {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}),
], ids=["gptq-dynamic-empty", "gptq-dynamic-null", "gptq-formats-agree", "gptq-format-alone",
        "fp8-largest-block", "ct-kv-scheme"])
def test_the_legal_neighbours_still_parse(q):
    assert parse_quantization({"quantization_config": q}, "config.json") is not None


def test_compressed_tensors_more_specific_target_wins():
    """compressed-tensors gives a module the scheme of its most specific target (match_targets:
    a name, then a regex, then the class `Linear`; of one target in two groups, the last): a
    mixed-precision config reads down_proj per tensor wherever its group stands."""
    linear = CONFIGS["ct-fp8"](dict(strategy="channel", act="none"))["config_groups"]["group_0"]
    down = dict(linear, targets=["re:.*down_proj$"], weights=dict(linear["weights"], strategy="tensor"))
    q_proj = "model.layers.0.self_attn.q_proj"
    for groups in ({"a": linear, "b": down}, {"a": down, "b": linear}):
        fmt = parse_quantization({"quantization_config": dict(CONFIGS["ct-fp8"]({}), config_groups=groups)}, "c")
        assert fmt.scheme_for("model.layers.0.mlp.down_proj").block_n == 1
        assert fmt.scheme_for("model.layers.0.mlp.down_proj").block_k is None
        assert fmt.sources("model.layers.0.mlp.down_proj", fmt.scheme_for("model.layers.0.mlp.down_proj"),
                           4, 4)["w_scale"].keys() == {"rows", "count"}, groups      # per tensor
        assert "rows" not in fmt.sources(q_proj, fmt.scheme_for(q_proj), 4, 4)["w_scale"]
    g32 = dict(W4["config_groups"]["group_0"])
    g64 = dict(g32, weights=dict(g32["weights"], group_size=64))
    fmt = parse_quantization({"quantization_config": dict(W4, config_groups={"a": g32, "b": g64})}, "c")
    assert fmt.scheme_for(q_proj).block_k == 64          # the same target twice: the last group's


Q = "model.layers.1.self_attn.q_proj"
D = "model.layers.0.mlp.down_proj"


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("q") / "m", tiny_shapes())


def _damaged(src, q, writer, o, name, damage, config=None):
    quantize_model(src, q, writer, workers=1, **o)
    ckpt = Checkpoint(q)
    tensors = {n: (ckpt.dtype(n), np.array(ckpt.raw(n))) for n in ckpt.where}
    ckpt.close()
    if name is not None:
        tensors[name] = damage(*tensors[name])
    write_safetensors(q / "model.safetensors", tensors)
    if config is not None:
        cfg = json.loads((q / "config.json").read_text())
        config(cfg["quantization_config"])
        (q / "config.json").write_text(json.dumps(cfg))
    return q


def _twice(dt, a):
    return dt, np.concatenate([a.reshape(-1), a.reshape(-1)])


def _drop_col(dt, a):
    return dt, np.ascontiguousarray(a[..., :-1])


# (id, writer, options, tensor to damage, damage, config change, what the error says)
BUILD_CASES = [
    # a per-tensor scale of two elements passed `infc build` and failed only at load
    ("fp8-tensor-scale-two", "fp8-tensor", {}, f"{D}.weight_scale_inv", _twice, None,
     f"'{D}.weight_scale_inv' has shape [2]: a per-tensor scale has one element"),
    ("ct-fp8-tensor-scale-two", "ct-fp8", dict(strategy="tensor", act="static"), f"{D}.weight_scale", _twice, None,
     f"'{D}.weight_scale' has shape [2]: a per-tensor scale has one element"),
    # a block checkpoint whose config lost weight_block_size reads per tensor: its scales say no
    ("fp8-block-config-lost-its-blocks", "fp8-block", dict(block=(32, 32)), None, None,
     lambda q: q.pop("weight_block_size"), "a per-tensor scale has one element"),
    # a fused q|k|v part's packed codes of the wrong width named the weight 'wqkv' thrice, no tensor
    ("gptq-fused-part-width", "gptq", dict(group=32), f"{Q}.qweight", _drop_col, None,
     f"'{Q}.qweight' [63, 64], 'model.layers.1.self_attn.k_proj.qweight' [32, 64]"),
    ("ct-fused-part-rows", "ct-int", dict(group=32), f"{Q}.weight_packed",
     lambda dt, a: (dt, np.ascontiguousarray(a[:-1])), None, f"'{Q}.weight_packed' [63, 64]"),
    # a config-level fault through the CLI: exit 2, not `internal error: TypeError` (exit 3)
    ("method-list", "awq", dict(group=32), None, None, lambda q: q.update(quant_method=["awq"]),
     "quantization_config.quant_method: list: must be a string"),
]


@pytest.mark.parametrize("writer,o,name,damage,config,says", [pytest.param(*c[1:], id=c[0]) for c in BUILD_CASES])
def test_build_fails_naming_it(writer, o, name, damage, config, says, src, capsys, monkeypatch, tmp_path):
    q = _damaged(src, tmp_path / "q", writer, o, name, damage, config)
    rc, out, err = build_dir(capsys, monkeypatch, tmp_path, q)
    assert rc == 2 and err.startswith("error: "), err
    assert says in err, err


def test_undamaged_per_tensor_checkpoints_still_build(src, capsys, monkeypatch, tmp_path):
    """The per-tensor scale check passes the checkpoints it is made for ([1] and [] scales)."""
    for writer, o in [("fp8-tensor", dict(act="static")), ("ct-fp8", dict(strategy="tensor", act="static"))]:
        q = _damaged(src, tmp_path / writer, writer, o, f"{D}.weight_scale_inv" if writer == "fp8-tensor" else None,
                     lambda dt, a: (dt, a.reshape(())), None)
        rc, out, err = build_dir(capsys, monkeypatch, tmp_path, q)
        assert rc == 0, err


# ---------------------------------------------------------------- NaN / infinite scales at load

from fake_cuda import FakeContext  # noqa: E402
from infc.compiler.build import compile_model  # noqa: E402
from infc.compiler.quant.kernel_limits import act_group_refusal  # noqa: E402
from infc.runtime.cuda.weights import DeviceWeights  # noqa: E402
from infc.runtime.weights.load import load_weights  # noqa: E402
from test_checkpoint_honesty import BASE  # noqa: E402


def _poison(value):
    """A scale tensor's last element made `value` (NaN, +-inf), in its stored dtype."""
    def damage(dt, a):
        a = np.array(a)
        flat = a.reshape(-1)
        flat[-1] = np.array([value], np.float32).view(np.uint32)[0] >> 16 if dt == "BF16" else value
        return dt, a
    return damage


# (id, writer, options, scale tensor, value): every float scale a format reads, the codes' NaN
# check's neighbours (runtime/weights/quant_recipes.py check_finite)
SCALE_CASES = [
    ("fp8-block-scale-nan", "fp8-block", dict(block=(32, 32)), f"{D}.weight_scale_inv", np.nan),
    ("fp8-tensor-scale-inf", "fp8-tensor", {}, f"{D}.weight_scale_inv", np.inf),
    ("fp8-tensor-input-scale-nan", "fp8-tensor", dict(act="static"), f"{D}.input_scale", np.nan),
    ("ct-fp8-channel-scale-neg-inf", "ct-fp8", dict(strategy="channel", act="none"), f"{D}.weight_scale", -np.inf),
    ("ct-int-group-scale-nan", "ct-int", dict(group=32), f"{Q}.weight_scale", np.nan),
    ("awq-scales-inf", "awq", dict(group=32), f"{D}.scales", np.inf),
    ("gptq-scales-nan", "gptq", dict(group=32), f"{Q}.scales", np.nan),
]


@pytest.mark.parametrize("writer,o,name,value", [pytest.param(*c[1:], id=c[0]) for c in SCALE_CASES])
def test_nan_or_infinite_scale_fails_the_load_naming_it(writer, o, name, value, src, tmp_path):
    """NaN e4m3 codes were refused at load, NaN or infinite scales loaded silently (every weight
    they scale NaN): both loaders, the numpy one and the device one, refuse them by name."""
    q = _damaged(src, tmp_path / "q", writer, o, name, _poison(value))
    _, plan = compile_model(spec_path=str(BASE), model_dir=str(q))      # the headers are honest
    ckpt = Checkpoint(q)
    try:
        with pytest.raises(ModelDirError, match=rf"'{name}' holds 1 NaN or infinite scale\(s\)"):
            load_weights(plan, ckpt)
    finally:
        ckpt.close()
    with pytest.raises(ModelDirError, match=rf"'{name}' holds 1 NaN or infinite scale\(s\)"):
        DeviceWeights(FakeContext(), plan, q, progress=False)


def test_finite_scales_still_load(src, tmp_path):
    for writer, o in [("fp8-block", dict(block=(32, 32))), ("fp8-tensor", dict(act="static")),
                      ("gptq", dict(group=32))]:
        q = _damaged(src, tmp_path / writer, writer, o, None, None)
        _, plan = compile_model(spec_path=str(BASE), model_dir=str(q))
        ckpt = Checkpoint(q)
        try:
            weights = load_weights(plan, ckpt)
        finally:
            ckpt.close()
        scales = [n for n in weights if n.endswith(("_qscale", "_xscale"))]
        assert scales and all(np.isfinite(a).all() for n in scales for a in weights[n]), writer


# ---------------------------------------------------------------- block sizes the kernels take

def test_fp8_block_size_the_kernels_refuse_names_the_key(src, capsys, monkeypatch, tmp_path):
    """[48, 48] built (the CPU backend computes any block) and then failed with exit 2 at a
    kernel's refusal of one launch (gemv: FMA_BLOCK_K a multiple of the act group); `infc build`
    now refuses it naming weight_block_size and what the kernels take."""
    for block in [(48, 48), (8, 8)]:
        q = _damaged(src, tmp_path / f"q{block[0]}", "fp8-block", dict(block=block), None, None)
        rc, out, err = build_dir(capsys, monkeypatch, tmp_path, q)
        assert rc == 2 and err.startswith("error: "), err
        assert f"config.json: quantization_config.weight_block_size {list(block)}:" in err, err
        assert "a power of two of at least 16 columns" in err and "[128, 128]" in err, err
        assert "kernel refuses" not in err, err


def test_fp8_block_sizes_in_use_still_build(src, capsys, monkeypatch, tmp_path):
    """The published 128 x 128 and the tests' kernel-built blocks build; the CPU backend's
    (compile_model: 16 x 48, 8 x 8) still compile there."""
    for block in [(128, 128), (64, 32), (32, 64), (32, 32), (32, 16), (16, 16), (24, 32)]:
        q = _damaged(src, tmp_path / f"q{block[0]}x{block[1]}", "fp8-block", dict(block=block), None, None)
        rc, out, err = build_dir(capsys, monkeypatch, tmp_path, q)
        assert rc == 0, (block, err)
    for block in [(16, 48), (8, 8)]:
        q = _damaged(src, tmp_path / f"c{block[0]}x{block[1]}", "fp8-block", dict(block=block), None, None)
        assert compile_model(spec_path=str(BASE), model_dir=str(q))[1]["weights"]


def test_kernel_act_group_rule():
    """compiler/quant/kernel_limits.py states the templates' refusals: gemv / gemm (a power of
    two, at least 16) and the MoE experts' expert_setup (16 to 512)."""
    assert all(act_group_refusal(g, expert=False) is None for g in (16, 32, 128, 1024, 2048))
    assert all(act_group_refusal(g, expert=True) is None for g in (16, 128, 512))
    assert all(act_group_refusal(g, expert=False) for g in (8, 24, 48, 96, 384))
    assert "16 to 512" in act_group_refusal(1024, expert=True)


def test_compressed_tensors_act_group_the_kernels_refuse_names_its_group():
    q = CONFIGS["ct-fp8"](dict(strategy="block", block=(128, 48), act="group"))
    fmt = parse_quantization({"quantization_config": q}, "config.json")
    s = fmt.scheme_for("model.layers.0.mlp.down_proj")
    msg = str(fmt.act_group_error(s, act_group_refusal(s.act_group, False)))
    assert msg.startswith(f"config.json: {G0}.input_activations.group_size: 48: "), msg


# ---------------------------------------------------------------- compressed-tensors targets

def _retarget(targets):
    return lambda q: q["config_groups"]["group_0"].update(targets=targets)


@pytest.mark.parametrize("targets", [["re:.*nothing$"], ["LlamaDecoderLayer"]], ids=["regex", "class"])
def test_compressed_tensors_targets_matching_no_linear(targets, src, capsys, monkeypatch, tmp_path):
    """compressed-tensors skips a target that matches no module, with a warning
    (match_named_modules(warn_on_fail=True) in apply_quantization_config): a legal config, so not
    refused at parse. Here no group quantizes the linears while the checkpoint stores them
    quantized: the missing plain weight was named with "did you mean '...weight_shape'?"; now the
    message says no scheme expected it quantized, which targets missed, and what is stored."""
    q = _damaged(src, tmp_path / "q", "ct-int", dict(group=32), None, None, _retarget(targets))
    rc, out, err = build_dir(capsys, monkeypatch, tmp_path, q)
    assert rc == 2 and err.startswith("error: "), err
    assert "with no scheme (no target of quantization_config.config_groups matches it: group_0: " \
           f"{targets}" in err, err
    assert "stores it quantized: 'model.layers.0.self_attn.o_proj.weight_packed' (I32)" in err, err
    assert "did you mean" not in err and "weight_shape" not in err, err


def test_compressed_tensors_target_matching_nothing_beside_one_that_matches_builds(src, capsys, monkeypatch,
                                                                                   tmp_path):
    q = _damaged(src, tmp_path / "q", "ct-int", dict(group=32), None, None,
                 _retarget(["re:.*experts.*", "Linear"]))
    rc, out, err = build_dir(capsys, monkeypatch, tmp_path, q)
    assert rc == 0, err


def test_missing_quantized_tensor_names_the_scheme_that_reads_it(src, capsys, monkeypatch, tmp_path):
    q = _damaged(src, tmp_path / "q", "ct-int", dict(group=32), None, None)
    ckpt = Checkpoint(q)
    tensors = {n: (ckpt.dtype(n), np.array(ckpt.raw(n))) for n in ckpt.where if n != f"{D}.weight_scale"}
    ckpt.close()
    write_safetensors(q / "model.safetensors", tensors)
    rc, out, err = build_dir(capsys, monkeypatch, tmp_path, q)
    assert rc == 2, err
    assert f"'{D}.weight_scale' (layer 0) is missing from {q}: {G0}'s scheme (u4 [1x32]" in err, err
    assert "pack-quantized) reads it" in err and "weight_shape" not in err, err
