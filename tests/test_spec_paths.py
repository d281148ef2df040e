"""Finding specs (compiler/spec_paths.py): --spec FILE, --spec-dir DIR and $INFC_SPEC_PATH, searched
before specs/; a model no spec implements says which architectures are known and how to point at
a spec; `infc build --spec FILE` alone builds the file's variants. Errors exit 2, no traceback."""
import json
import shutil
from pathlib import Path

import pytest

from infc.cli import main, parser
from infc.compiler.contract.errors import SpecError
from infc.compiler.spec import find_architecture, find_variant
from infc.compiler.spec_paths import SPECS_DIR, search_path

from test_checkpoint_honesty import BASE, tiny_shapes, write_model

KNOWN = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv("INFC_SPEC_PATH", raising=False)
    monkeypatch.delenv("INFC_DEBUG", raising=False)


def run(capsys, *args):
    rc = main(list(args))
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return rc, out, err


@pytest.fixture
def user_specs(tmp_path):
    d = tmp_path / "my-specs"
    d.mkdir()
    shutil.copy(BASE, d / "tiny.yaml")
    return d


def test_unknown_architecture_lists_the_known_and_says_how(capsys, tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"hidden_size": 8, "architectures": ["FooForCausalLM"]}, indent=2))
    rc, out, err = run(capsys, "build", "--model-path", str(d), "--out", str(tmp_path / "out"))
    assert rc == 2
    assert f"error: {d / 'config.json'}:3: no spec implements architectures ['FooForCausalLM']" in err, err
    for arch in KNOWN:
        assert arch in err, err
    for how in ("--spec FILE", "--spec-dir DIR", "INFC_SPEC_PATH"):
        assert how in err, err


def test_config_without_architectures(capsys, tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text('{"hidden_size": 8}')
    rc, out, err = run(capsys, "inspect", "--model-path", str(d))
    assert rc == 2
    assert f"{d / 'config.json'}: names no 'architectures' to pick a spec by; known architectures: " in err, err


def test_missing_spec_dir(capsys, tmp_path):
    rc, out, err = run(capsys, "build", "--model", "tiny", "--spec-dir", str(tmp_path / "nope"),
                       "--out", str(tmp_path / "out"))
    assert rc == 2
    assert f"error: --spec-dir: spec directory '{tmp_path / 'nope'}' does not exist" in err, err


def test_spec_dir_is_a_file(capsys, tmp_path):
    rc, out, err = run(capsys, "inspect", "tiny", "--spec-dir", str(BASE))
    assert rc == 2 and f"spec directory '{BASE}' is not a directory" in err, err


def test_missing_env_spec_dir(capsys, monkeypatch, tmp_path, user_specs):
    monkeypatch.setenv("INFC_SPEC_PATH", f"{user_specs}:{tmp_path / 'gone'}")
    rc, out, err = run(capsys, "build", "--model", "tiny", "--out", str(tmp_path / "out"))
    assert rc == 2
    assert f"error: INFC_SPEC_PATH: spec directory '{tmp_path / 'gone'}' does not exist" in err, err


def test_unknown_variant_says_how_to_point(capsys, tmp_path):
    rc, out, err = run(capsys, "build", "--model", "tiny", "--out", str(tmp_path / "out"))
    assert rc == 2
    assert "unknown variant 'tiny'" in err and "--spec-dir DIR" in err and str(SPECS_DIR) in err, err


def test_broken_spec_in_a_spec_dir_is_named(capsys, tmp_path, user_specs):
    (user_specs / "broken.yaml").write_text("family: broken\nconfig: [1, 2\n")
    rc, out, err = run(capsys, "build", "--model", "qwen3-0.6b", "--spec-dir", str(user_specs),
                       "--no-compile", "--out", str(tmp_path / "out"))
    assert rc == 2 and f"{user_specs / 'broken.yaml'}:" in err and "YAML syntax error" in err, err


def test_spec_dir_finds_the_architecture(capsys, tmp_path, user_specs):
    d = write_model(tmp_path / "m", tiny_shapes())
    rc, out, err = run(capsys, "build", "--model-path", str(d), "--spec-dir", str(user_specs),
                       "--no-compile", "--out", str(tmp_path / "out"))
    assert rc == 0, err
    assert json.loads((tmp_path / "out" / "plan.json").read_text())["family"] == "tiny"


def test_env_spec_path_finds_a_variant(capsys, monkeypatch, tmp_path, user_specs):
    monkeypatch.setenv("INFC_SPEC_PATH", str(user_specs))
    rc, out, err = run(capsys, "build", "--model", "tiny", "--no-compile", "--out", str(tmp_path / "out"))
    assert rc == 0, err
    rc, out, err = run(capsys, "inspect", "tiny")
    assert rc == 0 and f"spec {user_specs / 'tiny.yaml'}" in out, err


def test_user_dirs_come_before_specs(monkeypatch, tmp_path, user_specs):
    """A user's spec for an architecture the built-in specs also claim takes precedence."""
    text = (SPECS_DIR / "llama.yaml").read_text().replace("family: llama", "family: my-llama")
    (user_specs / "llama.yaml").write_text(text)
    assert find_architecture(["LlamaForCausalLM"], [user_specs]).family == "my-llama"
    assert find_architecture(["LlamaForCausalLM"]).family == "llama"
    monkeypatch.setenv("INFC_SPEC_PATH", str(user_specs))
    assert find_variant("smollm2-135m")[0].family == "my-llama"
    other = tmp_path / "other"
    other.mkdir()
    assert search_path([other]) == [other, user_specs, SPECS_DIR]    # flag, then env, then specs/


def test_build_spec_alone_builds_every_variant(capsys, tmp_path):
    spec = tmp_path / "two.yaml"
    text = BASE.read_text().replace(
        "variants:\n", "variants:\n  tiny-wide: {hidden_size: 128, intermediate_size: 128, num_hidden_layers: 1, "
                       "num_attention_heads: 4, num_key_value_heads: 2, vocab_size: 256, rms_norm_eps: 1.0e-6, "
                       "rope_theta: 10000}\n")
    spec.write_text(text)
    rc, out, err = run(capsys, "build", "--spec", str(spec), "--no-compile", "--out", str(tmp_path / "out"))
    assert rc == 0, err
    for v in ("tiny", "tiny-wide"):
        assert json.loads((tmp_path / "out" / v / "plan.json").read_text())["model"] == v


@pytest.mark.parametrize("variants", ["", "variants: {}\n"])
def test_build_spec_without_variants(capsys, tmp_path, variants):
    lines = BASE.read_text().splitlines(keepends=True)
    start = next(i for i, l in enumerate(lines) if l.startswith("variants:"))
    kept = lines[:start] + lines[start + 4:]
    text = "".join(kept) + variants
    line = len(kept) + 1 if variants else 1
    spec = tmp_path / "novariants.yaml"
    spec.write_text(text)
    rc, out, err = run(capsys, "build", "--spec", str(spec), "--out", str(tmp_path / "out"))
    assert rc == 2
    assert f"error: {spec}:{line}: this spec names no variants" in err, err
    assert "--model-path DIR" in err
    assert not (tmp_path / "out").exists()


def test_build_spec_alone_reports_the_spec_error(capsys, tmp_path):
    bad = Path(__file__).parent / "malformed_specs" / "unknown_op.yaml"
    rc, out, err = run(capsys, "build", "--spec", str(bad), "--out", str(tmp_path / "out"))
    assert rc == 2 and f"{bad}:44: unknown op 'linaer'" in err, err


def test_serve_and_generate_take_spec_dir(tmp_path):
    from infc.server.args import backend_kwargs
    a = parser().parse_args(["serve", "--model-path", "/m", "--spec-dir", "a", "--spec-dir", "b"])
    assert backend_kwargs(a)["spec_dirs"] == ["a", "b"]
    assert parser().parse_args(["generate", "--model-path", "/m", "--prompt", "x",
                                "--spec-dir", "a"]).spec_dir == ["a"]


def test_llm_takes_spec_dirs(tmp_path, user_specs):
    from infc import LLM
    d = write_model(tmp_path / "m", tiny_shapes())
    llm = LLM(d, device="cpu", spec_dirs=[str(user_specs)], kv_cache_tokens=64)
    assert llm.plan["family"] == "tiny"
    out = llm.generate([[1, 2, 3]], None)
    assert len(out[0].token_ids) > 0
    with pytest.raises(SpecError, match="no spec implements architectures"):
        LLM(write_model(tmp_path / "m2", tiny_shapes(), arch="BarForCausalLM"), device="cpu")
