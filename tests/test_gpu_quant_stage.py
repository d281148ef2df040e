"""The GPU `quant` stage's part that runs here (tests/gpu/prepare.py quant): the config-only
Qwen3-4B-FP8 directory carries exactly the quantization_config tools/quantize_model.py writes on
the GPU machine (so the artifact built here is the one `infc serve` reuses there), and its build
is the quantized plan: with cubins where the kernels render a quantized launch, else plan.json
alone and a line saying so (never a half-built artifact)."""
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "tests" / "gpu"), str(REPO / "tools")]
import prepare  # noqa: E402
from quantize_model import quantize_model  # noqa: E402

from exhaustive import EXHAUSTIVE  # noqa: E402
from test_device_weights import model  # noqa: E402


def test_prepare_quant_builds_what_the_gpu_machine_serves(tmp_path, monkeypatch, capsys):
    from infc.compiler.build import build

    def one_table(what, out, **kw):          # prepare's two tables, without compiling: the plan is the point
        build(out=out, log=None, compile=False, **kw)

    monkeypatch.setattr(prepare, "GPU_CACHE", tmp_path / "gpu")
    monkeypatch.setattr(prepare, "_both_tunings", one_table)
    monkeypatch.setattr(prepare, "QUANT_DUMMY", {})    # (48 layers: ~10 s more; its config is checked below)
    prepare.quant(tmp_path / "art")
    cfg = json.loads((tmp_path / "gpu" / "configs" / "qwen3-4b-fp8" / "config.json").read_text())
    bf16 = json.loads((tmp_path / "gpu" / "configs" / "qwen3-4b" / "config.json").read_text())
    src, out = tmp_path / "tiny", tmp_path / "tiny-fp8"
    model(src, "qwen3")
    _, fmt, options = prepare.QUANT_FORMATS["qwen3-4b-fp8"]
    written = quantize_model(src, out, fmt, **options)
    assert cfg == {**bf16, "quantization_config": written}
    art = tmp_path / "art" / "qwen3-4b-fp8"
    plan = json.loads((art / "plan.json").read_text())
    dtypes = {w["dtype"] for w in plan["weights"].values()}
    assert "f8e4m3" in dtypes and plan["weights"]["wqkv"]["shape"] == [4096 + 2 * 1024, 2560]
    said = capsys.readouterr().out
    if (art / "kernels").is_dir():               # the quantized kernels render
        assert "refuse" not in said
    else:
        assert "the kernels refuse a quantized launch" in said and sorted(p.name for p in art.iterdir()) == ["plan.json"]
    # qwen3-30b-a3b's 4-layer cut as Qwen3-30B-A3B-FP8: the experts read quantized (128 x 128
    # blocks per expert), the four routers left bf16 by name, the expert kernels rendered
    moe = json.loads((tmp_path / "gpu" / "configs" / "qwen3-30b-a3b-l4-fp8" / "config.json").read_text())
    assert moe["quantization_config"]["modules_to_not_convert"] == \
        ["lm_head"] + [f"model.layers.{i}.mlp.gate" for i in range(4)]
    plan = json.loads((tmp_path / "art" / "qwen3-30b-a3b-l4-fp8" / "plan.json").read_text())
    w = plan["weights"]
    assert w["we_gate_up"]["dtype"] == "f8e4m3" and w["we_gate_up_qscale"]["shape"] == [128, 12, 16]
    assert w["we_down_qscale"]["shape"] == [128, 16, 6] and w["router"]["dtype"] == "bf16"
    assert (tmp_path / "art" / "qwen3-30b-a3b-l4-fp8" / "kernels").is_dir()


def test_prepare_writes_the_whole_moe_fp8_config_timed_with_dummy_weights(tmp_path, monkeypatch):
    """QUANT_DUMMY's qwen3-30b-a3b FP8 (session.sh quant times it with --load-format dummy): the
    bf16 benchmark's config (the same as .cache/gpu/configs/qwen3-30b-a3b) with the writer's
    quantization_config, its 48 routers left bf16 by name."""
    monkeypatch.setattr(prepare, "GPU_CACHE", tmp_path / "gpu")
    import prepare_moe
    monkeypatch.setattr(prepare_moe, "GPU_CACHE", tmp_path / "gpu")
    name, (base, fmt, _) = next(iter(prepare.QUANT_DUMMY.items()))
    cfg = json.loads((prepare.quant_config(name) / "config.json").read_text())
    bf16 = json.loads((prepare_moe.write_config(base) / "config.json").read_text())
    q = cfg.pop("quantization_config")
    assert cfg == bf16 and bf16["num_hidden_layers"] == 48 and fmt == "fp8-block"
    assert q["quant_method"] == "fp8" and q["weight_block_size"] == [128, 128]
    assert q["modules_to_not_convert"] == ["lm_head"] + sorted(f"model.layers.{i}.mlp.gate" for i in range(48))


def test_prepare_predicts_the_routers_the_writer_ignores(tiny_model, tmp_path):
    """The config-only quantization_config of an MoE model names the routers exactly as
    tools/quantize_model.py does from the checkpoint (the artifact built here is the one the GPU
    machine's quantized directory reuses)."""
    from quantize_model import quantization_config
    src, _ = tiny_model("qwen3_moe", mlp_only_layers=[1])
    written = quantize_model(src, tmp_path, "fp8-block")
    cfg = json.loads((src / "config.json").read_text())
    assert written == quantization_config("fp8-block", {}, prepare.moe_routers(cfg))
    assert written["modules_to_not_convert"] == ["lm_head", "model.layers.0.mlp.gate", "model.layers.2.mlp.gate"]


def _hf_and_reference(qdir, ids):
    """(hf_quant's float32 model of qdir, its logits at every position of ids, the numpy
    reference's logits at every position, one step a prefix)."""
    import numpy as np
    import torch
    import hf_quant
    from infc.compiler.build import compile_model
    from infc.compiler.contract.safetensors_io import Checkpoint
    from infc.runtime.engine.step import Chunk
    from infc.runtime.reference.executor import ReferenceExecutor
    from infc.runtime.weights.load import load_weights
    m = hf_quant.load(qdir, torch.float32).eval()
    with torch.no_grad():
        hf = m(torch.tensor([ids])).logits[0].numpy()
    _, plan = compile_model(model_dir=str(qdir))
    ex = ReferenceExecutor(plan, load_weights(plan, Checkpoint(qdir)))
    return m, hf, np.stack([ex.step([Chunk(t, ids[:t + 1], 0)])[0] for t in range(len(ids))])


def test_hf_quant_computes_the_format_definition(tmp_path, monkeypatch):
    """tests/gpu/hf_quant.py (the quant golden gate's HF side): transformers' dequantized fp8 model
    with the activation quantization hooked in equals the numpy reference (the definition) at
    every position, in float32; without the hooks it does not."""
    import numpy as np
    import torch
    import hf_quant
    src, q = tmp_path / "bf16", tmp_path / "fp8"
    model(src, "qwen3")
    quantize_model(src, q, "fp8-block", block=(16, 48))
    ids = [5, 17, 33, 2, 99, 250, 7, 8, 9]
    m, hf, ours = _hf_and_reference(q, ids)
    with torch.no_grad():
        monkeypatch.setattr(hf_quant, "quantize_groups", lambda x, group: x)    # the hooks do nothing
        plain = m(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(hf, ours, rtol=1e-4, atol=1e-5)
    assert np.abs(plain - ours).max() > 1e-3            # the activation quantization is what it adds


def test_hf_quant_computes_the_format_definition_for_experts(tiny_model, tmp_path):
    """hf_quant.load on an MoE checkpoint (the golden gate of qwen3-30b-a3b-l4-fp8): transformers'
    fused experts hold the experts' dequantized weights and quantize each projection's input:
    equal to the numpy reference at every position; without the quantizer they are not."""
    import numpy as np
    import torch
    src, _ = tiny_model("qwen3_moe", moe_intermediate_size=128)
    quantize_model(src, tmp_path, "fp8-block")
    ids = [11, 200, 3, 77, 150, 9, 31, 260]
    m, hf, ours = _hf_and_reference(tmp_path, ids)
    np.testing.assert_allclose(hf, ours, rtol=1e-4, atol=1e-5)
    experts = m.model.layers[0].mlp.experts
    del experts.forward                                   # HF's own expert loop, no quantizer
    with torch.no_grad():
        plain = m(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(plain - ours).max() > 1e-3


@pytest.mark.parametrize("fmt,options", [("ct-int", {"bits": 4, "group": 32}), ("awq", {"group": 32}),
                                         pytest.param("fp8-tensor", {"act": "static"}, marks=EXHAUSTIVE)])
def test_hf_quant_by_definition_equals_the_reference(tmp_path, fmt, options):
    """hf_quant.load on the other formats (the golden gate of qwen3-4b-w4a16, AWQ-shaped int4):
    HF built without the quantization_config, each quantized linear holding its definition
    (tests/quant_definitions.py) equals the numpy reference at every position, in float32."""
    import numpy as np
    src, q = tmp_path / "bf16", tmp_path / "q"
    model(src, "qwen3")
    quantize_model(src, q, fmt, **options)
    _, hf, ours = _hf_and_reference(q, [5, 17, 33, 2, 99, 250, 7, 8, 9])
    np.testing.assert_allclose(hf, ours, rtol=1e-4, atol=1e-5)


def test_hf_quant_by_definition_fills_the_fused_experts(tiny_model, tmp_path):
    """hf_quant.load on an MoE checkpoint in a format transformers is not given (compressed-tensors
    int4 experts, group 32: the golden gate of qwen3-30b-a3b-l4-w4a16, Kimi-K2's expert format):
    HF fuses the experts into one module, so each stored expert's definition goes into its rows of
    the fused stacks; equal to the numpy reference at every position, in float32."""
    import numpy as np
    src, _ = tiny_model("qwen3_moe", moe_intermediate_size=128)
    quantize_model(src, tmp_path, "ct-int", bits=4, group=32)
    m, hf, ours = _hf_and_reference(tmp_path, [11, 200, 3, 77, 150, 9, 31, 260])
    np.testing.assert_allclose(hf, ours, rtol=1e-4, atol=1e-5)
