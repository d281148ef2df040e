"""The longest sequence a plan's model takes (compiler/contract/schema.py plan_max_len), one rule for
the CUDA runner, the engine and the draft model: a spec without `max_len` (ALiBi families) has no
limit; every committed plan whose family's config.json names a position limit carries it (the
CUDA runner once read plan["config"]["max_len"] directly, and DeepSeek-V4's spec named none)."""
import json
from pathlib import Path

import pytest

from infc.compiler.contract.schema import NO_MAX_LEN, plan_max_len

GENERATED = Path(__file__).resolve().parents[1] / "generated"


def test_plan_max_len_reads_the_config_or_sets_no_limit():
    assert plan_max_len({"config": {"max_len": 4096}}) == 4096
    assert plan_max_len({"config": {"max_len": None}}) == NO_MAX_LEN
    assert plan_max_len({"config": {}}) == NO_MAX_LEN
    assert plan_max_len({}) == NO_MAX_LEN


# committed variants whose model has no position limit in its config (ALiBi, no table)
UNLIMITED = {"bloom-560m"}


@pytest.mark.parametrize("variant", sorted(p.name for p in GENERATED.iterdir() if (p / "plan.json").is_file()))
def test_committed_plans_carry_their_position_limit(variant):
    plan = json.loads((GENERATED / variant / "plan.json").read_text())
    got = plan_max_len(plan)
    if variant in UNLIMITED:
        assert got == NO_MAX_LEN
    else:
        assert 512 <= got < NO_MAX_LEN, f"{variant}: plan config max_len {plan['config'].get('max_len')}"
