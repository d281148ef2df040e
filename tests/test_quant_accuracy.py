"""bench/quant_accuracy.py (`infc bench quant-accuracy`) on the CPU: the teacher-forced rows are
the logits at the right positions (each equals a fresh prefill of the sequence up to there),
KL and top-1 are the textbook ones (torch's kl_div on the same rows), a model against itself
is 0 / 100 %, and a tiny model's fp8-block checkpoint is close to its bf16 one but not equal;
the command writes its result and refuses a missing directory in one line (`infc bench
quant-accuracy` calls main with its arguments)."""
import json
import sys

import numpy as np
import pytest
import torch

from infc.bench import quant_accuracy as qa
from infc.compiler.build import compile_model
from infc.compiler.contract.safetensors_io import Checkpoint
from infc.runtime.engine.step import Chunk
from infc.runtime.reference.executor import ReferenceExecutor
from infc.runtime.weights.load import load_weights






def test_rows_are_the_positions_after_each_token(fp8_pair):
    src, _ = fp8_pair
    seqs = qa.sequences(300, 3, 9, 4, seed=3)
    got = qa.cpu_logits(src, seqs, 4)
    _, plan = compile_model(model_dir=str(src))
    ex = ReferenceExecutor(plan, load_weights(plan, Checkpoint(src)))
    for i, s in enumerate(seqs):
        n = len(s) - 4
        for t in range(4):             # a fresh sequence of the first n + t tokens: its last row
            want = ex.step([Chunk(100 * i + t, s[:n + t], 0)])[0]
            np.testing.assert_allclose(got[i][t], want, rtol=1e-4, atol=1e-5)


def test_kl_and_top1_are_the_textbook_ones():
    rng = np.random.default_rng(0)
    a = [rng.standard_normal((5, 40)).astype(np.float32) * 3 for _ in range(2)]
    b = [x + rng.standard_normal(x.shape).astype(np.float32) for x in a]
    res = qa.compare(a, b)
    p, q = torch.tensor(np.concatenate(a)).double(), torch.tensor(np.concatenate(b)).double()
    kl = torch.nn.functional.kl_div(q.log_softmax(-1), p.log_softmax(-1), log_target=True, reduction="none").sum(-1)
    assert res["positions"] == 10 and res["mean_kl"] == pytest.approx(float(kl.mean()), rel=1e-9)
    assert res["max_kl"] == pytest.approx(float(kl.max()), rel=1e-9)
    assert res["top1_agreement"] == float((p.argmax(-1) == q.argmax(-1)).double().mean())
    assert res["mean_kl"] != pytest.approx(qa.compare(b, a)["mean_kl"], rel=1e-3)   # KL(bf16 || quant), not reversed
    with pytest.raises(ValueError, match="not the same positions"):
        qa.compare(a, [x[:, :30] for x in b])


def test_fp8_model_against_its_bf16_model(fp8_pair, tmp_path, capsys):
    src, q = fp8_pair
    same = qa.run(src, src, count=3, prompt_len=8, decode=4)
    assert same["mean_kl"] == 0.0 and same["top1_agreement"] == 1.0 and same["positions"] == 12
    res = qa.run(src, q, count=3, prompt_len=8, decode=4)
    assert 1e-7 < res["mean_kl"] < 1e-2 and res["top1_agreement"] >= 0.75, res
    assert res["quantization_config"]["quant_method"] == "fp8"
    qa.main(["--reference", str(src), "--model-path", str(q), "--sequences", "3", "--prompt-len", "8",
             "--decode", "4", "--out", str(tmp_path)])
    saved = json.loads(next(tmp_path.glob("quant-accuracy-*.json")).read_text())
    assert saved["mean_kl"] == pytest.approx(res["mean_kl"]) and "top-1 agreement" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:          # one line, no traceback
        qa.main(["--reference", str(src), "--model-path", str(tmp_path / "nowhere")])
    assert str(e.value.code).startswith("infc bench quant-accuracy: ") and "nowhere" in str(e.value.code)
