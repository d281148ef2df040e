"""tools/quantize_model.py at real shapes: fp8_block_quantize works on whole strips of blocks,
and the tensors are quantized by several processes, without changing a byte of the output: the
strips equal the per-block loop (the format's definition, written out here) on ragged blocks,
and a model written by 3 workers is the same file as by 1. encode_e4m3 (from the float bits)
equals the table search it replaced, and refuses what is no e4m3 number."""
import sys
from pathlib import Path

import numpy as np
import pytest

from infc.compiler.contract.safetensors_io import E4M3
from infc.compiler.ops.quant import round_e4m3
from infc.compiler.quant.scheme import FP8_MAX
from infc.runtime.weights.quant_pack import encode_e4m3

from test_device_weights import model

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import quant_math  # noqa: E402
import quantize_model as qm  # noqa: E402


def per_block(w, bn, bk):
    n, k = w.shape
    s = np.zeros((-(-n // bn), -(-k // bk)), np.float32)
    q = np.zeros_like(w, dtype=np.float32)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]
            amax = np.abs(blk).max()
            s[i, j] = amax / np.float32(FP8_MAX) if amax > 0 else 1.0
            q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = round_e4m3(blk / s[i, j])
    return q, s


@pytest.mark.parametrize("block,strip", [((16, 32), 1 << 18), ((7, 13), 300), ((128, 128), 1 << 18), ((5, 500), 64)])
def test_strips_equal_the_per_block_loop(block, strip, monkeypatch):
    monkeypatch.setattr(quant_math, "_STRIP", strip)        # several strips, a ragged last one
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((93, 301)) * 0.05).astype(np.float32)
    w[:16, :40] = 0                                  # an all-zero block: scale 1
    w[50, 7] = 3.0                                   # an outlier block
    q, s = qm.fp8_block_quantize(w, *block)
    q0, s0 = per_block(w, *block)
    assert q.shape == w.shape and s.shape == s0.shape
    assert np.array_equal(q, q0) and np.array_equal(s, s0)


def test_workers_write_the_same_file(tmp_path):
    src = tmp_path / "bf16"
    model(src, "qwen3")
    a, b = tmp_path / "a", tmp_path / "b"
    qm.quantize_model(src, a, "fp8-block", workers=1, block=(16, 48))
    qm.quantize_model(src, b, "fp8-block", workers=3, block=(16, 48))
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "config.json").read_text() == (b / "config.json").read_text()


def test_encode_e4m3_from_bits():
    finite = E4M3[np.isfinite(E4M3)]
    assert np.array_equal(E4M3[encode_e4m3(finite)], finite)
    assert np.array_equal(encode_e4m3(np.float32([-0.0, 0.0, 448, -2.0 ** -9])), np.uint8([0x80, 0, 0x7E, 0x81]))
    for bad in (0.3, 449.0, 2.0 ** -10, 1e-30, np.nan, -np.inf, 1e30):
        with pytest.raises(ValueError, match="not e4m3 codes"):
            encode_e4m3(np.float32([1.0, bad]))
