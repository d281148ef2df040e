"""tests/gpu/build_variants.py refuses an overlay entry that no launch of the plan renders with: an
A/B whose keys name launches a fusion has since changed builds its base twice and measures nothing
(Qwen3.5's chunk-size A/B did, bench/NOTES.md 2026-12-06 #6)."""
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "gpu"))

from build_variants import unmatched  # noqa: E402

from infc.compiler.codegen.render import tuning_keys  # noqa: E402
from infc.compiler.contract.program import launches  # noqa: E402


def test_an_overlay_key_no_launch_renders_with_is_named():
    plan = json.loads((REPO / "generated" / "qwen3.5-4b" / "plan.json").read_text())
    rule = next(ln for ln, _ in launches(plan["programs"]["prefill"]) if ln["op"] == "gated_delta_rule")
    (key,) = tuning_keys(plan, rule, "prefill")
    assert unmatched(plan, {"gated_delta_rule_chunk": {key: {"BV": 32}}}) == []
    stale = "prefill|Tx16x128;Tx16x128;Tx32x128;Tx32;Tx32;Tx32x128"     # the launch before fuse_delta_gates
    assert unmatched(plan, {"gated_delta_rule_chunk": {key: {"BV": 32}, stale: {"BT": 16}}}) == \
        [f"gated_delta_rule_chunk / {stale}"]
    assert unmatched(plan, {"gemv": {key: {}}}) == [f"gemv / {key}"]      # the key, not another template's
    # a "default" entry reaches every launch of its template: named only where none launches it
    assert unmatched(plan, {"gemv": {"default": {"FP8_FORM": "fma"}}}) == []
    assert unmatched(plan, {"moe_down": {"default": {}}}) == ["moe_down / default"]
