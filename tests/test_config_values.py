"""Every value a spec binds from config.json is checked (compiler/config_values.py, Spec.bind):
`infc build --model-path DIR --no-compile` answers each broken config with exit 2 and
`error: DIR/config.json:LINE: config key 'KEY' ...`, never an internal error (exit 3)."""
import json

import pytest
from test_checkpoint_honesty import BASE, TINY, build_dir

from infc.compiler import config_values
from infc.compiler.spec import load_spec

# key -> the raw JSON text written for it, and what the message must say
CASES = {
    "layers_zero": ("num_hidden_layers", "0", "must be a positive integer (symbol L is a size): 0 is not in 1.."),
    "layers_negative": ("num_hidden_layers", "-3", "-3 is not in 1.."),
    "layers_float": ("num_hidden_layers", "2.5", "2.5 is a number, not an integer"),
    "layers_whole_float": ("num_hidden_layers", "2.0", "2.0 is a number, not an integer"),
    "layers_bool": ("num_hidden_layers", "true", "True is a boolean, not an integer"),
    "layers_string": ("num_hidden_layers", '"2"', "'2' is a string, not an integer"),
    "layers_null": ("num_hidden_layers", "null", "None is null, not an integer"),
    "hidden_string": ("hidden_size", '"64"', "symbol H is a size"),
    "heads_float": ("num_attention_heads", "4.0", "symbol Hq is a size"),
    "vocab_huge": ("vocab_size", "99999999999999999999999", "is not in 1..2147483647"),
    "hidden_nan": ("hidden_size", "NaN", "is nan: not a finite number"),
    "eps_infinity": ("rms_norm_eps", "Infinity", "is inf: not a finite number"),
    "eps_overflow": ("rms_norm_eps", "1e400", "is inf: not a finite number"),
    "eps_string": ("rms_norm_eps", '"1e-6"', "must be a number (symbol eps), got '1e-6'"),
    "eps_list": ("rms_norm_eps", "[1e-6]", "must be a number (symbol eps)"),
    "theta_negative_infinity": ("rope_theta", "-Infinity", "is -inf: not a finite number"),
    "tie_string": ("tie_word_embeddings", '"yes"', "must be a boolean (symbol tie), got 'yes'"),
    "act_number": ("hidden_act", "5", "must be a string (symbol act), got 5"),
}


def write_config(d, key, raw):
    d.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": ["TinyForCausalLM"], **TINY, "hidden_act": "silu", key: "@@"}
    text = json.dumps(cfg, indent=2).replace('"@@"', raw)
    (d / "config.json").write_text(text)
    line = next(n for n, s in enumerate(text.splitlines(), 1) if f'"{key}"' in s)
    return d / "config.json", line


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_config_value_names_file_and_key(case, capsys, monkeypatch, tmp_path):
    key, raw, message = CASES[case]
    cfg, line = write_config(tmp_path / "m", key, raw)
    rc, out, err = build_dir(capsys, monkeypatch, tmp_path, tmp_path / "m")
    assert rc == 2, err
    assert err.startswith(f"error: {cfg}:{line}: config key '{key}' "), err
    assert message in err, err


def test_nested_non_finite_value_is_located(capsys, monkeypatch, tmp_path):
    """rope_scaling holds numbers too: a NaN inside is named with where it sits."""
    spec = tmp_path / "tiny.yaml"
    spec.write_text(BASE.read_text().replace("  act: hidden_act = \"silu\"\n",
                                             "  act: hidden_act = \"silu\"\n  rs: rope_scaling = none\n"))
    cfg, line = write_config(tmp_path / "m", "rope_scaling", '{"rope_type": "linear", "factor": NaN}')
    rc, out, err = build_dir(capsys, monkeypatch, tmp_path, tmp_path / "m", spec)
    assert rc == 2 and f"{cfg}:{line}: config key 'rope_scaling' holds at ['factor'] nan" in err, err


@pytest.mark.parametrize("text", ["[1, 2]", '"config"', "3", "null"])
def test_config_that_is_not_an_object(text, capsys, monkeypatch, tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(text)
    rc, out, err = build_dir(capsys, monkeypatch, tmp_path, d)
    assert rc == 2 and f"error: {d / 'config.json'}: a JSON " in err and "not an object" in err, err


def test_architectures_of_the_wrong_type(capsys, monkeypatch, tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**TINY, "architectures": 5}))
    rc, out, err = build_dir(capsys, monkeypatch, tmp_path, d)
    assert rc == 2 and "config.json:" in err and "'architectures' must be a list" in err, err


def test_derived_size_names_the_spec_line(capsys, monkeypatch, tmp_path):
    """D = H // Hq is 0 when Hq > H: the derived size is refused at the spec's line."""
    cfg, _ = write_config(tmp_path / "m", "num_attention_heads", "128")
    rc, out, err = build_dir(capsys, monkeypatch, tmp_path, tmp_path / "m")
    assert rc == 2 and f"{BASE}:10: default of D ('H // Hq' in {cfg}) is a size" in err, err


def test_what_each_symbol_needs_is_read_from_the_spec():
    spec = load_spec(BASE)
    assert config_values.size_symbols(spec) == {"H", "L", "Hq", "Hkv", "D", "F", "V"}
    kinds = {s: config_values.expected_kinds(spec, b) for s, b in spec.bindings.items()}
    assert kinds["eps"] == {"a number"} and kinds["tie"] == {"a boolean"} and kinds["act"] == {"a string"}


def test_valid_configs_still_build(capsys, monkeypatch, tmp_path):
    """Ints where the variants hold floats (rope_theta 10000 vs 10000.0) are numbers alike."""
    cfg, _ = write_config(tmp_path / "m", "rope_theta", "500000.0")
    rc, out, err = build_dir(capsys, monkeypatch, tmp_path, tmp_path / "m")
    assert rc == 0, err
