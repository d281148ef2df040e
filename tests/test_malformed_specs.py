"""A bad spec fails with `file:line: what is wrong`, exit code 2 and no traceback.

Each tests/malformed_specs/<case>.yaml is base_valid.yaml with one mistake (its first line says
which). Most cases run `infc.cli.main` in-process; a few run `python -m infc.cli` end to end to
prove the exit code and the absence of a traceback in a real process.
"""
import subprocess
import sys
from pathlib import Path

import pytest

from infc.cli import main

HERE = Path(__file__).resolve().parent / "malformed_specs"
BASE = HERE / "base_valid.yaml"

# case -> (line of the mistake, a specific piece of the message)
CASES = {
    # YAML itself
    "yaml_syntax": (28, "YAML syntax error: expected ',' or ']', but got '}'"),
    "yaml_tab": (37, "YAML syntax error: found character '\\t'"),
    "duplicate_key": (38, "duplicate key 'wo'"),
    # top level and config
    "unknown_top_key": (26, "unknown top-level key 'wieghts'; did you mean 'weights'?"),
    "missing_graph": (1, "missing required key 'graph'"),
    "reserved_symbol": (12, "symbol 'T' is reserved"),
    "config_not_a_key": (11, "symbol 'F' must name a config.json key"),
    "missing_config_key": (12, "config key 'vocab_size' (symbol V) is missing"),
    "default_unknown_symbol": (10, "default of D uses unknown symbol 'Hqq'; did you mean 'Hq'?"),
    "default_div_zero": (10, "default of D: cannot evaluate 'H // 0': integer division or modulo by zero"),
    "nested_config_not_a_list": (4, "'nested_config' must be a list of config.json object names, like [text_config]"),
    "variant_not_mapping": (22, "variant 'tiny2' must be a mapping of config.json keys to values"),
    # requires
    "requires_fails": (19, "requirement 'act == \"gelu\"' does not hold (act = 'silu')"),
    "requires_unknown_symbol": (19, "requirement 'activation == \"silu\"' uses unknown symbol 'activation'"),
    "requires_syntax": (19, "cannot parse expression 'act === \"silu\"'"),
    "requires_type": (19, "requirement 'act > 2' cannot be evaluated: '>' not supported"),
    "requires_not_list": (18, "'requires' must be a list of conditions"),
    # weights
    "bad_dtype": (34, "weight 'wq' has unknown dtype 'fp8'"),
    "bad_dtype_block": (40, "weight 'wo' has unknown dtype 'float8'"),
    "weight_unknown_field": (28, "weight 'final_norm' has unknown field(s) ['shap']; did you mean 'shape'?"),
    "weight_no_name": (41, "weight 'wd' has no 'name'"),
    "duplicate_weight": (42, "duplicate weight name 'final_norm' in weights and layer.weights"),
    "unknown_symbol_shape": (34, "weight 'wq': unknown symbol 'Dh' in shape; did you mean 'D'?"),
    "non_integer_shape": (34, "weight 'wq': shape dimension 'Hq * D / 3' = 21.333333333333332 is not a positive integer"),
    "unsupported_expression": (34, "weight 'wq': unsupported expression 'Hq * D << 1'"),
    "dynamic_dim_weight": (28, "weight 'final_norm': shape uses the dynamic dimension 'T'"),
    "layer_weight_no_index": (34, "layer weight 'wq' name has no {i} layer index"),
    "when_unknown_symbol": (29, "weight 'lm_head': 'when' names unknown symbol 'tied'; did you mean 'tie'?"),
    "tied_to_unknown": (29, "weight 'lm_head' is tied to unknown weight 'embedding'; did you mean 'embed'?"),
    # graph statements
    "statement_syntax": (43, "cannot parse statement 'h = rms_norm(x, attn_norm, eps': '(' was never closed"),
    "statement_not_assignment": (43, "a graph statement is 'name = op(...)'"),
    "unknown_op": (44, "unknown op 'linaer'; did you mean 'linear'?"),
    "unknown_name": (47, "attention: unknown name 'vv'"),
    "missing_weight": (49, "linear: unknown name 'wd' (not a declared weight, a step input or an assigned value)"),
    "layer_weight_at_top": (55, "linear: 'wq' is a layer weight; only layer.graph can use it"),
    "unknown_symbol_attr": (43, "rms_norm: unknown symbol 'epsilon'; did you mean 'eps'?"),
    "unknown_keyword": (43, "rms_norm has no parameter 'epsilon'; signature rms_norm(x, weight, eps)"),
    "wrong_arity": (43, "rms_norm takes at most 3 arguments rms_norm(x, weight, eps), got 4"),
    "missing_argument": (43, "rms_norm is missing argument(s) eps"),
    "wrong_targets": (44, "view returns 1 value(s) but 2 name(s) are assigned"),
    "config_as_tensor": (47, "attention: 'v' must be a tensor, but 'H' is a config value"),
    "tensor_as_attr": (43, "rms_norm: 'eps' must be a config value or a constant, but 'x' is a tensor"),
    "literal_as_tensor": (48, "rms_norm: 'x' must be a tensor name or an op call, got '1'"),
    "duplicate_target": (44, "duplicate name in targets of 'q, q = view("),
    "assign_to_weight": (43, "name 'wq' is already a weight"),
    "assign_to_symbol": (43, "name 'eps' is already a config symbol"),
    "cycle": (54, "cycle in graph: 'u' (line 54) -> 'w' (line 55) -> 'u'"),
    "cycle_self": (47, "cycle in graph: 'a' (line 47) -> 'a'"),
    "dynamic_dim_expr": (48, "view: dynamic dimension T/B must stand alone, got 'T * 2'"),
    # layers
    "layers_without_layer": (33, "layers(...) is used but the spec has no 'layer' section"),
    "layers_targets": (54, "layers carries 2 value(s) but 1 are assigned"),
    "layer_never_assigns": (54, "the layer graph never assigns carried value 'x'"),
    # shapes (infer_types)
    "shape_mismatch": (48, "linear: input bf16[T, 64] has K=64 but weight bf16[64, 128] has K=128"),
    "view_element_count": (44, "view: cannot view bf16[T, 64] as [T, 2, 16] (element counts differ)"),
    "carried_changes_type": (50, "layer changes carried value 'x' from bf16[T, 64] to bf16[T, 128]"),
    # checkpoint tensors the spec does not read on purpose (compiler/checkpoint_check.py)
    "ignore_not_list": (57, "'ignore' must be a list of glob patterns of checkpoint tensor names"),
    "ignore_entry_not_string": (58, "'ignore' entries must be non-empty glob patterns (strings), got 3"),
    # load-time transforms, defaults, activations, layer kinds
    "default_empty": (10, "symbol 'D': nothing after '='"),
    "rows_not_pair": (34, "weight 'wq': 'rows' must be [start, stop] or [start, stop, step] (a "
                          "slice of the checkpoint tensor's first axis), got [0]"),
    "rows_empty": (34, "weight 'wq': rows [8, 8] is empty"),
    "rows_wrong_length": (34, "weight 'wq': rows [0, 32] holds 32 rows but the declared shape [64, 64] needs 64"),
    "transpose_not_bool": (41, "weight 'wd': 'transpose' must be true or false, got 'yes'"),
    "scale_unknown_symbol": (28, "weight 'final_norm': scale: unknown symbol 'sqrt_h'"),
    "unknown_activation": (50, "act: unknown activation 'swishy' (known: gelu, gelu_new"),
    "kind_undefined": (32, "layer 1 has kind 'wide', which 'layer.kinds' does not define (defined: narrow)"),
    "kind_without_kinds": (32, "'layer' has 'kind' but no 'kinds'"),
    "kind_unknown_key": (34, "unknown key 'symbol' in layer kind 'narrow'; did you mean 'symbols'?"),
    "kind_symbol_unknown": (34, "layer kind 'narrow': symbol F uses unknown symbol 'G'"),
    # weight names with config fields, row groups, stored shapes, a spec's split (issue 12)
    "name_unknown_symbol": (34, "weight name '{pfx}layers.{i}.self_attn.q_proj.weight' uses unknown symbol 'pfx'"),
    "groups_without_rows": (34, "weight 'wq': 'groups' divides the rows that 'rows' slices; give 'rows' too"),
    "groups_wrong_length": (34, "weight 'wq': rows [0, 8] in each of 4 groups holds 32 rows but the "
                                "declared shape [64, 64] needs 64"),
    "stored_shape_mismatch": (41, "weight 'wd': stored_shape [64, 2, 128] flattens to [64, 256], which "
                                  "the declared shape [64, 128] cannot come from"),
    "split_not_2d": (44, "split takes a 2-D x [rows, N] (its parts are row-strided views), got bf16[T, 4, 16]"),
}
MODEL = {"variant_not_mapping": "tiny2"}


def _build(capsys, monkeypatch, tmp_path, *args):
    monkeypatch.delenv("INFC_DEBUG", raising=False)
    rc = main(["build", *args, "--out", str(tmp_path / "out")])
    out, err = capsys.readouterr()
    return rc, out, err


def test_base_spec_is_valid(capsys, monkeypatch, tmp_path):
    rc, out, err = _build(capsys, monkeypatch, tmp_path, "--spec", str(BASE), "--model", "tiny")
    assert rc == 0, err
    assert (tmp_path / "out" / "plan.json").is_file()


def test_every_malformed_spec_has_a_case():
    files = {p.stem for p in HERE.glob("*.yaml")} - {BASE.stem}
    assert files == set(CASES)


@pytest.mark.parametrize("case", sorted(CASES))
def test_malformed_spec(case, capsys, monkeypatch, tmp_path):
    line, message = CASES[case]
    path = HERE / f"{case}.yaml"
    rc, out, err = _build(capsys, monkeypatch, tmp_path, "--spec", str(path),
                          "--model", MODEL.get(case, "tiny"))
    assert rc == 2, err
    assert err.startswith("error: "), err
    assert f"{path}:{line}: " in err, err
    assert message in err, err
    assert "Traceback" not in err + out
    assert not (tmp_path / "out").exists()


def test_unknown_variant_names_the_known_ones(capsys, monkeypatch, tmp_path):
    rc, out, err = _build(capsys, monkeypatch, tmp_path, "--model", "no-such-model")
    assert rc == 2
    assert "unknown variant 'no-such-model'" in err
    for known in ("qwen3-0.6b", "qwen3-4b", "qwen3-8b"):
        assert known in err
    rc, out, err = _build(capsys, monkeypatch, tmp_path, "--model", "qwen3-4")
    assert rc == 2 and "did you mean 'qwen3-4b'?" in err


def test_unknown_variant_of_a_spec_file(capsys, monkeypatch, tmp_path):
    rc, out, err = _build(capsys, monkeypatch, tmp_path, "--spec", str(BASE), "--model", "nope")
    assert rc == 2
    assert f"{BASE}" in err and "unknown variant 'nope' (this spec defines: tiny)" in err


def _cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "infc.cli", *args], capture_output=True,
                          text=True, cwd=cwd, timeout=120,
                          env={k: v for k, v in __import__("os").environ.items()
                               if k != "INFC_DEBUG"})


@pytest.mark.parametrize("case", ["yaml_syntax", "shape_mismatch", "cycle"])
def test_malformed_spec_end_to_end(case, tmp_path):
    line, message = CASES[case]
    path = HERE / f"{case}.yaml"
    r = _cli("build", "--spec", str(path), "--model", "tiny", "--out", str(tmp_path / "out"),
             cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert f"{path}:{line}: {message}" in r.stderr
    assert "Traceback" not in r.stderr + r.stdout


def test_unknown_variant_end_to_end(tmp_path):
    r = _cli("build", "--model", "no-such-model", "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert r.returncode == 2
    assert "unknown variant 'no-such-model'" in r.stderr and "qwen3-4b" in r.stderr
    assert "Traceback" not in r.stderr + r.stdout
