"""Checkpoint honesty for quantized tensors (compiler/quant/leaves.py, compiler/checkpoint_check.py):
a quantized tensor stored with the wrong dtype or shape fails `infc build` naming the tensor, from
the safetensors headers, before any weight is read. The models are tests/malformed_specs/
base_valid.yaml's tiny ones (H 64, F 128), quantized by tools/quantize_model.py and then damaged."""
import sys
from pathlib import Path

import numpy as np
import pytest

from infc.compiler.build import compile_model
from infc.compiler.contract.safetensors_io import Checkpoint
from test_checkpoint_honesty import BASE, build_dir, tiny_shapes, write_model

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
from quantize_model import quantize_model, write_safetensors  # noqa: E402

Q = "model.layers.1.self_attn.q_proj"
D = "model.layers.0.mlp.down_proj"


# each damage: (safetensors dtype, array as stored) -> the same, damaged
def _f16(dt, a):
    return "F16", np.zeros(a.shape, np.float16)


def _extra_row(dt, a):
    return dt, np.concatenate([a, a[:1]], 0)


def _drop_col(dt, a):
    return dt, np.ascontiguousarray(a[..., :-1])


def _flat(dt, a):
    return dt, a.reshape(a.shape[0], -1)


# (id, writer, options, tensor to damage, damage, what the error says beside the tensor's name)
CASES = [
    ("gptq-qweight-f16", "gptq", dict(group=32), f"{Q}.qweight", _f16, "has dtype F16"),
    ("gptq-scales-groups", "gptq", dict(group=32), f"{D}.scales", _extra_row, "shape"),
    ("gptq-gidx-2d", "gptq", dict(group=32, desc_act=True), f"{Q}.g_idx", _flat, "a group index is 1-D"),
    ("gptq-qzeros-width", "gptq", dict(group=32, sym=False), f"{Q}.qzeros", _drop_col, "int32 words"),
    ("awq-qweight-width", "awq", dict(group=32), f"{D}.qweight", _drop_col, "int32 words"),
    ("awq-scales-groups", "awq", dict(group=32), f"{Q}.scales", _extra_row, "shape"),
    ("ct-packed-width", "ct-int", dict(group=32), f"{Q}.weight_packed", _drop_col, "int32 words"),
    ("ct-zero-rows", "ct-int", dict(group=32, sym=False), f"{D}.weight_zero_point", _extra_row, "int32 words"),
    ("ct-scale-groups", "ct-int", dict(group=32), f"{D}.weight_scale", _drop_col, "shape"),
    ("ct-fp8-weight-f16", "ct-fp8", {}, f"{Q}.weight", _f16, "has dtype F16"),
    ("mxfp4-blocks-shape", "mxfp4", {}, f"{Q}.weight_blocks", _flat, "MXFP4 blocks"),
    ("mxfp4-scales-f32", "mxfp4", {}, f"{D}.weight_scales", lambda dt, a: ("F32", a.astype(np.float32)),
     "has dtype F32"),
]


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("q") / "m", tiny_shapes())


@pytest.mark.parametrize("writer,o,name,damage,says", [pytest.param(*c[1:], id=c[0]) for c in CASES])
def test_damaged_quantized_tensor_names_it(writer, o, name, damage, says, src, capsys, monkeypatch, tmp_path):
    q = tmp_path / "q"
    quantize_model(src, q, writer, **o)
    ckpt = Checkpoint(q)
    tensors = {n: (ckpt.dtype(n), np.array(ckpt.raw(n))) for n in ckpt.where}
    ckpt.close()
    tensors[name] = damage(*tensors[name])
    write_safetensors(q / "model.safetensors", tensors)
    rc, out, err = build_dir(capsys, monkeypatch, tmp_path, q)
    assert rc == 2 and err.startswith("error: "), err
    assert f"'{name}'" in err and says in err, err


@pytest.mark.parametrize("writer,o", [("gptq", dict(group=32, desc_act=True, sym=False)), ("awq", dict(group=32)),
                                      ("ct-int", dict(group=32, sym=False)), ("mxfp4", {})])
def test_undamaged_quantized_checkpoint_passes(writer, o, src, tmp_path):
    """The same checkpoints undamaged pass the check (its bookkeeping tensors, which the formats
    leave unread, included) and plan quantized linears."""
    quantize_model(src, tmp_path / "q", writer, **o)
    log = []
    _, plan = compile_model(spec_path=BASE, model_dir=tmp_path / "q", log=log.append)
    assert any("check checkpoint tensors" in line for line in log)
    assert {w["dtype"] for w in plan["weights"].values()} & {"u4", "e2m1"}


@pytest.mark.parametrize("writer,o", [("gptq", dict(group=32, desc_act=True, sym=False)), ("gptq", dict(group=32)),
                                      ("awq", dict(group=32)), ("ct-int", dict(group=32, sym=False)),
                                      ("ct-fp8", dict(act="static")), ("mxfp4", {}), ("fp8-block", {})])
def test_format_names_the_tensors_it_stores(writer, o, src, tmp_path):
    """QuantFormat.tensors(): exactly the module's tensors in the checkpoint, with their dtypes,
    less the bookkeeping the format leaves unread."""
    from fnmatch import fnmatchcase
    from infc.compiler.quant.formats import parse_quantization
    config = quantize_model(src, tmp_path, writer, **o)
    fmt = parse_quantization({"quantization_config": config}, "config.json")
    ckpt = Checkpoint(tmp_path)
    named = fmt.tensors(Q, fmt.scheme_for(Q))
    stored = {n for n in ckpt.where if n.startswith(Q + ".") and not any(fnmatchcase(n, p) for p in fmt.unread)}
    assert set(named) == stored
    assert all(ckpt.dtype(n) in named[n] for n in stored)
