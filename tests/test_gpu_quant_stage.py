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
    written = quantize_model(src, out, prepare.QUANT_FORMATS["qwen3-4b-fp8"])
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
