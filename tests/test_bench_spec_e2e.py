"""`infc bench spec-e2e` on the CPU: speculation's end-to-end time per token at acceptance rates set
by construction. A draft model other than the target (a 1-layer model of the same vocabulary,
dummy weights) is accepted ~never on its own, so the measured acceptance is the forced one's: all
at rate 1 (k + 1 tokens a step), none at rate 0 (one), some at 0.5; the wrapper comes off after."""
import json

import pytest

from infc.bench import spec_e2e
from test_dummy_weights import config_only


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from infc import LLM
    root = tmp_path_factory.mktemp("spec-e2e")
    target, draft = config_only(root / "target"), config_only(root / "draft", num_hidden_layers=1)
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    kw = dict(device="cpu", load_format="dummy", max_num_seqs=8)
    with LLM(target, speculative_config=spec, **kw) as llm:
        yield llm


def test_forced_rates(engines):
    llm = engines
    settle = llm.engine.spec.settle
    res = spec_e2e.measure(llm, [1.0, 0.0, 0.5], prompt_len=6, max_tokens=25)
    assert llm.engine.spec.settle == settle                   # the wrapper came off
    one, none, half = res["results"]
    assert res["k"] == 3 and res["plain_ms_per_token"] > 0
    assert one["tokens"] == none["tokens"] == half["tokens"] == 25
    assert one["acceptance"] == 1.0 and one["tokens_per_step"] > 3.4     # 24 tokens after the first, 4 a step
    assert none["accepted"] == 0 and none["drafted"] > 0 and none["tokens_per_step"] == 1.0
    assert 0.2 < half["acceptance"] < 0.8 and 1.2 < half["tokens_per_step"] < 2.6
    assert half["expected_tokens_per_step"] == pytest.approx(1.875)
    assert all(r["ms_per_token"] > 0 and r["speedup"] > 0 for r in res["results"])


def test_bad_rates():
    for text in ("1,x", "1.5", ""):
        with pytest.raises(ValueError, match="--accept"):
            spec_e2e._rates(text)


def test_main_writes_the_report(tmp_path, capsys):
    d = config_only(tmp_path / "m")
    spec = json.dumps({"method": "draft_model", "model": str(d), "num_speculative_tokens": 2})
    spec_e2e.main(["--model-path", str(d), "--speculative-config", spec, "--load-format", "dummy", "--device", "cpu",
                   "--accept", "1", "--prompt-len", "4", "--max-tokens", "8", "--out", str(tmp_path / "out")])
    text = capsys.readouterr().out
    assert "accept 1.00" in text and "wrote" in text
    report = json.loads(next((tmp_path / "out").glob("spec-e2e-*.json")).read_text())
    assert report["results"][0]["acceptance"] == 1.0 and report["gpu"] == "cpu"
