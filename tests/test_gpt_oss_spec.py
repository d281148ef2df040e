"""specs/gpt_oss.yaml's new vocabulary refuses what it does not compute, naming the spec line:
an expert activation it has no kernel for, sinks that are not one per query head, a strided
column slice that does not give the declared shape, and an expert stack's transform that does not
apply per expert. (The family's numbers: tests/test_families_vs_hf.py, test_families_interp.py,
test_gpt_oss_mxfp4.py.)"""
from pathlib import Path

import pytest

from infc.compiler.build import compile_model
from infc.compiler.contract.errors import SpecError

SPEC = (Path(__file__).resolve().parent.parent / "specs" / "gpt_oss.yaml").read_text()


def _line(text: str, needle: str) -> int:
    """The line a statement or weight declaration starts on (what the errors name)."""
    return next(i for i, l in enumerate(text.splitlines(), 1) if needle in l)


@pytest.mark.parametrize("old,new,at,message", [
    ('act="clamped_swiglu"', 'act="clamped_gelu"', "moe_experts(h,",
     "moe_experts: act must be one of silu, clamped_swiglu, clamped_silu or an activation"),
    ("shape: [Hq], dtype: f32", "shape: [Hkv], dtype: f32", "a = attention(",
     "attention sinks must be [64] (one per query head)"),
    ("cols: [0, 2*F, 2]", "cols: [0, 2*F, 3]", "we_gate:",
     "weight 'we_gate': cols [0, 5760, 3] holds 1920 cols but the declared shape [2880, 2880] needs 2880"),
    ("cols: [1, 2*F, 2], transpose: true}", "cols: [1, 2*F, 2], transpose: true, stored_shape: [H, 2, F]}",
     "we_up:",
     "weight 'we_up': heads / stored_shape do not apply to an expert stack read from one tensor"),
])
def test_gpt_oss_spec_errors(old, new, at, message, tmp_path):
    assert old in SPEC
    text = SPEC.replace(old, new, 1)
    path = tmp_path / "gpt_oss.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as e:
        compile_model("gpt-oss-20b", spec_path=str(path))
    assert message in str(e.value)
    assert e.value.line == _line(text, at), str(e.value)
