"""`infc tune` on the MoE templates: candidate manifests for the decode and grouped kernels, and
the routing the tuner feeds them (the grouped kernels' per-expert token lists must follow the
launch's ids, not be random)."""
import json

import numpy as np

from infc.compiler.ops import REGISTRY
from infc.compiler.tune import prepare
from infc.runtime.cuda.tune_run import moe_grouping

TEMPLATES = ("moe_gate_up", "moe_down", "moe_gate_up_grouped", "moe_down_grouped", "moe_route")


def test_prepare_moe_manifest_derives_the_grouping(tmp_path):
    out = prepare("qwen3-30b-a3b", "h200", out=tmp_path / "prep", templates=TEMPLATES, compile=False,
                  log=None, decode_batches=(1, 8))
    m = json.loads((out / "manifest.json").read_text())
    got = {(e["template"], e["phase"]) for e in m["entries"]}
    assert {("moe_gate_up", "decode"), ("moe_down", "decode"), ("moe_gate_up_grouped", "prefill"),
            ("moe_down_grouped", "prefill"), ("moe_route", "decode"), ("moe_route", "prefill")} <= got
    for e in m["entries"]:
        assert len(e["candidates"]) >= 4 and e["candidates"][0]["tune"] == {}
        ins = e["inputs"]
        derived = [t for t in ins if "derive" in t]
        if e["op"] in ("moe_gate_up", "moe_down"):
            ids = ins[1 if e["op"] == "moe_gate_up" else 2]
            assert ids["dtype"] == "i32" and ids["high"] == 128
            assert [(t["derive"]["moe_align"], t["derive"]["ids"], t["derive"]["experts"]) for t in derived] == \
                [("rows", ids["name"], 128), ("counts", ids["name"], 128)]
        else:
            assert not derived


def test_tuner_grouping_is_moe_align():
    ids = np.random.default_rng(0).integers(0, 10, (37, 8)).astype(np.int32)   # repeats in a row too
    got = moe_grouping(ids, 10)
    rows, counts = REGISTRY["moe_align"].reference(None, ids, experts=10)
    assert np.array_equal(got["rows"], rows) and np.array_equal(got["counts"], counts)
