"""The GPU `quant` stage's part that runs here (tests/gpu/prepare.py quant): the config-only
Qwen3-4B-FP8 directory carries exactly the quantization_config tools/quantize_model.py writes on
the GPU machine (so the artifact built here is the one `infc serve` reuses there), and its build
is the quantized plan: with cubins where the kernels render a quantized launch, else plan.json
alone and a line saying so (never a half-built artifact)."""
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "tests" / "gpu"), str(REPO / "tools")]
import prepare  # noqa: E402
from quantize_model import quantize_model  # noqa: E402

from test_device_weights import model  # noqa: E402


def test_prepare_quant_builds_what_the_gpu_machine_serves(tmp_path, monkeypatch, capsys):
    from infc.compiler.build import build

    def one_table(what, out, **kw):          # prepare's two tables, without compiling: the plan is the point
        build(out=out, log=None, compile=False, **kw)

    monkeypatch.setattr(prepare, "GPU_CACHE", tmp_path / "gpu")
    monkeypatch.setattr(prepare, "_both_tunings", one_table)
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


def test_hf_quant_computes_the_format_definition(tmp_path, monkeypatch):
    """tests/gpu/hf_quant.py (the quant golden gate's HF side): transformers' dequantized fp8 model
    with the activation quantization hooked in equals the numpy reference (the definition) at
    every position, in float32; without the hooks it does not."""
    import numpy as np
    import torch
    import hf_quant
    from infc.compiler.build import compile_model
    from infc.compiler.contract.safetensors_io import Checkpoint
    from infc.runtime.engine.step import Chunk
    from infc.runtime.reference.executor import ReferenceExecutor
    from infc.runtime.weights.load import load_weights
    src, q = tmp_path / "bf16", tmp_path / "fp8"
    model(src, "qwen3")
    quantize_model(src, q, "fp8-block", block=(16, 48))
    ids = [5, 17, 33, 2, 99, 250, 7, 8, 9]
    m = hf_quant.load(q, torch.float32).eval()
    with torch.no_grad():
        hf = m(torch.tensor([ids])).logits[0].numpy()
        monkeypatch.setattr(hf_quant, "quantize_groups", lambda x, group: x)    # the hooks do nothing
        plain = m(torch.tensor([ids])).logits[0].numpy()
    _, plan = compile_model(model_dir=str(q))
    ex = ReferenceExecutor(plan, load_weights(plan, Checkpoint(q)))
    ours = np.stack([ex.step([Chunk(t, ids[:t + 1], 0)])[0] for t in range(len(ids))])
    np.testing.assert_allclose(hf, ours, rtol=1e-4, atol=1e-5)
    assert np.abs(plain - ours).max() > 1e-3            # the activation quantization is what it adds
