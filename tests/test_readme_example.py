"""The README's worked example (a Mistral spec written by a user) builds as the README says."""
import re
from pathlib import Path

from infc.compiler.build import compile_model
from infc.compiler.inspect import count_launches

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_mistral_spec_builds(tmp_path):
    block = re.search(r"```yaml\n(# Mistral.*?)```", README.read_text(), re.S).group(1)
    spec = tmp_path / "mistral.yaml"
    spec.write_text(block)
    _, plan = compile_model("mistral-7b-v0.3", spec_path=str(spec))
    assert plan["family"] == "mistral"
    assert plan["weights"]["wqkv"]["shape"] == [4096 + 2 * 1024, 4096]
    _, per_layer = count_launches(plan["programs"]["decode"])
    assert per_layer == 8
