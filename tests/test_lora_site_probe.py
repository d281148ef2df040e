"""tools/experiments/lora_site_probe.py (issue 46): every variant's lines are still in gemv.py.j2 (a
template edit that drops one fails here, not on the GPU machine), the patched template is what the
build renders while the tool runs, and tests/gpu/rerender.py refuses the tool's builds."""
import sys
from pathlib import Path

import pytest

from infc.compiler.codegen import render

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools" / "experiments"))
sys.path.insert(0, str(REPO / "tests" / "gpu"))
import lora_site_probe  # noqa: E402
from rerender import rerender  # noqa: E402


@pytest.fixture
def restore_env():
    yield
    render._env_for.cache_clear()


@pytest.mark.parametrize("name", sorted(lora_site_probe.VARIANTS))
def test_a_variants_lines_are_in_the_template(name, restore_env):
    env = lora_site_probe._patched(name)
    text = env.loader.get_source(env, lora_site_probe.TEMPLATE)[0]
    for old, new in lora_site_probe.VARIANTS[name]:
        assert new in text
    assert text != (render.TEMPLATES / lora_site_probe.TEMPLATE).read_text()
    assert render._env() is env                  # what a build renders with while the tool runs


def test_a_template_without_the_line_is_refused(restore_env, monkeypatch):
    monkeypatch.setitem(lora_site_probe.VARIANTS, "broken", [("no such line in the template", "x")])
    with pytest.raises(SystemExit, match="the template changed"):
        lora_site_probe._patched("broken")


def test_rerender_leaves_a_probe_build_to_the_tool(tmp_path):
    (tmp_path / "plan.json").write_text('{"build": {"gpu": "h200"}}')
    (tmp_path / "lora_site_probe").write_text("p1\n")
    assert "re-render it with that tool" in rerender(tmp_path, gpu="h100")
