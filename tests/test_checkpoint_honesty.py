"""A checkpoint that does not match its spec fails the build, naming the tensor and the spec's
file:line (compiler/checkpoint_check.py); a model no spec implements says how to point at one
(compiler/spec_paths.py). Every failure: exit code 2, `error: file:line: what`, no traceback.

The model directories are tiny real ones: config.json + model.safetensors written with numpy,
at the shapes of tests/malformed_specs/base_valid.yaml's `tiny` variant (or mutated from them).
Recipes the specs here do not produce (slice, transpose, scale, offset, zeros, stacks) are
checked with hand-written plan dicts (schema infc.plan/2) against real safetensors files.
"""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from infc.cli import main
from infc.compiler.checkpoint_check import check_model_dir
from infc.compiler.contract.errors import SpecError
from infc.compiler.spec import load_spec

HERE = Path(__file__).resolve().parent
BASE = HERE / "malformed_specs" / "base_valid.yaml"
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, rms_norm_eps=1e-6, rope_theta=10000,
            tie_word_embeddings=True)
# base_valid.yaml's line of each weight declaration
LINE = {"embed": 27, "final_norm": 28, "lm_head": 29, "attn_norm": 33, "wq": 34, "wk": 35,
        "wv": 36, "wo": 37, "mlp_norm": 38, "wg": 39, "wu": 40, "wd": 41}


def tiny_shapes(layers=2) -> dict:
    H, F, V, qd, kvd = 64, 128, 256, 64, 32
    out = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        out |= {p + "input_layernorm.weight": (H,), p + "self_attn.q_proj.weight": (qd, H),
                p + "self_attn.k_proj.weight": (kvd, H), p + "self_attn.v_proj.weight": (kvd, H),
                p + "self_attn.o_proj.weight": (H, qd), p + "post_attention_layernorm.weight": (H,),
                p + "mlp.gate_proj.weight": (F, H), p + "mlp.up_proj.weight": (F, H),
                p + "mlp.down_proj.weight": (H, F)}
    return out


def write_model(d: Path, shapes: dict, config: dict | None = None, dtypes: dict | None = None,
                arch="TinyForCausalLM") -> Path:
    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    tensors = {n: rng.standard_normal(s).astype((dtypes or {}).get(n, np.float32))
               for n, s in shapes.items()}
    save_file(tensors, str(d / "model.safetensors"))
    cfg = {"architectures": [arch] if arch else None, **TINY, **(config or {})}
    if arch is None:
        del cfg["architectures"]
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    return d


def run(capsys, monkeypatch, *args):
    monkeypatch.delenv("INFC_DEBUG", raising=False)
    rc = main(list(args))
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return rc, out, err


def build_dir(capsys, monkeypatch, tmp_path, model_dir, spec=BASE, *extra):
    return run(capsys, monkeypatch, "build", "--model-path", str(model_dir), "--spec", str(spec),
               "--no-compile", "--out", str(tmp_path / "out"), *extra)


def expect_error(rc, err, file, line, *messages):
    assert rc == 2, err
    assert err.startswith("error: "), err
    where = f"{file}:{line}: " if line is not None else f"{file}: "
    assert where in err, err
    for m in messages:
        assert m in err, err


# ------------------------------------------------------------------ a matching checkpoint builds

def test_matching_checkpoint_builds(capsys, monkeypatch, tmp_path):
    d = write_model(tmp_path / "m", tiny_shapes())
    rc, out, err = build_dir(capsys, monkeypatch, tmp_path, d)
    assert rc == 0, err
    assert "check checkpoint tensors" in out


def test_config_only_directory_is_not_checked(capsys, monkeypatch, tmp_path):
    """A build machine may have config.json alone: nothing to check, the build still runs."""
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["TinyForCausalLM"], **TINY}))
    rc, out, err = build_dir(capsys, monkeypatch, tmp_path, d)
    assert rc == 0, err
    assert "checkpoint not checked" in out


def test_tied_weight_stored_anyway_is_accounted_for(capsys, monkeypatch, tmp_path):
    """tie_word_embeddings with lm_head.weight stored too: the tied declaration accounts for it."""
    d = write_model(tmp_path / "m", tiny_shapes() | {"lm_head.weight": (256, 64)})
    rc, out, err = build_dir(capsys, monkeypatch, tmp_path, d)
    assert rc == 0, err


def test_ignore_pattern_allows_an_unused_tensor(capsys, monkeypatch, tmp_path):
    spec = tmp_path / "tiny.yaml"
    spec.write_text(BASE.read_text() + '\nignore:\n  - "model.layers.*.self_attn.rotary_emb.inv_freq"\n')
    d = write_model(tmp_path / "m", tiny_shapes() | {f"model.layers.{i}.self_attn.rotary_emb.inv_freq": (8,)
                                                       for i in range(2)})
    rc, out, err = build_dir(capsys, monkeypatch, tmp_path, d, spec)
    assert rc == 0, err


# ------------------------------------------------------------------ checkpoint cases (exit 2)

def _drop(name):
    return lambda s: {k: v for k, v in s.items() if k != name}


def _set(name, shape):
    return lambda s: s | {name: shape}


# case -> (mutation of the tensor shapes, config overrides, weight whose line is named, message parts)
CHECKPOINT_CASES = {
    "missing_tensor": (_drop("model.layers.1.self_attn.k_proj.weight"), {}, "wk",
                       ["weight 'wk'", "checkpoint tensor 'model.layers.1.self_attn.k_proj.weight' "
                        "(layer 1) is missing from"]),
    "missing_model_level_tensor": (_drop("model.norm.weight"), {}, "final_norm",
                                   ["weight 'final_norm': checkpoint tensor 'model.norm.weight' is missing"]),
    "missing_untied_lm_head": (lambda s: s, {"tie_word_embeddings": False}, "lm_head",
                               ["weight 'lm_head': checkpoint tensor 'lm_head.weight' is missing"]),
    "wrong_shape": (_set("model.norm.weight", (65,)), {}, "final_norm",
                    ["weight 'final_norm': checkpoint tensor 'model.norm.weight' has shape [65], "
                     "the spec expects [64]"]),
    "wrong_rows_in_fused_part": (_set("model.layers.0.self_attn.k_proj.weight", (48, 64)), {}, "wk",
                                 ["weight 'wk'", "checkpoint tensor 'model.layers.0.self_attn.k_proj.weight' "
                                  "gives shape [48, 64], the spec expects [32, 64]"]),
    "wrong_columns_in_fused_part": (_set("model.layers.1.mlp.up_proj.weight", (128, 65)), {}, "wu",
                                    ["checkpoint tensor 'model.layers.1.mlp.up_proj.weight' has shape "
                                     "[128, 65], the spec expects [128, 64]"]),
    "transposed_tensor": (_set("model.layers.0.mlp.down_proj.weight", (128, 64)), {}, "wd",
                          ["weight 'wd': checkpoint tensor 'model.layers.0.mlp.down_proj.weight' has "
                           "shape [128, 64], the spec expects [64, 128]"]),
    "wrong_rank": (_set("model.layers.1.input_layernorm.weight", (1, 64)), {}, "attn_norm",
                   ["has shape [1, 64], the spec expects [64]"]),
    "tied_copy_wrong_shape": (_set("lm_head.weight", (255, 64)), {}, "lm_head",
                              ["weight 'lm_head' (tied to 'embed'): the checkpoint also stores "
                               "'lm_head.weight' with shape [255, 64], the spec declares [256, 64]"]),
    "more_layers_than_config": (lambda s: s | {k.replace("layers.1.", "layers.2."): v for k, v in s.items()
                                               if "layers.1." in k}, {}, "attn_norm",
                                ["checkpoint tensor 'model.layers.2.input_layernorm.weight'",
                                 "matches weight 'attn_norm', which this configuration does not load "
                                 "(layer 2 is past the config's 2 layers); also unread: "
                                 "'model.layers.2.mlp.down_proj.weight'", " and 5 more"]),
    "misspelled_tensor": (lambda s: {k.replace("o_proj", "out_proj"): v for k, v in s.items()}, {}, "wo",
                          ["checkpoint tensor 'model.layers.0.self_attn.o_proj.weight' (layer 0) is "
                           "missing from", "did you mean 'model.layers.0.self_attn.out_proj.weight'?"]),
}


@pytest.mark.parametrize("case", sorted(CHECKPOINT_CASES))
def test_checkpoint_case(case, capsys, monkeypatch, tmp_path):
    mutate, config, weight, messages = CHECKPOINT_CASES[case]
    d = write_model(tmp_path / "m", mutate(tiny_shapes()), config)
    rc, out, err = build_dir(capsys, monkeypatch, tmp_path, d)
    expect_error(rc, err, BASE, LINE[weight], *messages)
    assert not (tmp_path / "out").exists()


def test_missing_layers(capsys, monkeypatch, tmp_path):
    """config.json says 2 layers, the checkpoint has 1: the first layer-1 tensor read is named."""
    d = write_model(tmp_path / "m", {k: v for k, v in tiny_shapes().items() if "layers.1." not in k})
    rc, out, err = build_dir(capsys, monkeypatch, tmp_path, d)
    assert rc == 2, err
    m = re.search(rf"^error: {re.escape(str(BASE))}:(\d+): weight '(\w+)'.*checkpoint tensor "
                  rf"'model\.layers\.1\.[\w.]+' \(layer 1\) is missing", err)
    assert m and LINE[m.group(2)] == int(m.group(1)), err


def test_unused_tensor_points_at_weights(capsys, monkeypatch, tmp_path):
    """No `ignore:` list: the error points at `weights:` (where a declaration would go)."""
    d = write_model(tmp_path / "m", tiny_shapes() | {"model.layers.0.self_attn.q_proj.bias": (64,)})
    rc, out, err = build_dir(capsys, monkeypatch, tmp_path, d)
    expect_error(rc, err, BASE, 26,
                 "checkpoint tensor 'model.layers.0.self_attn.q_proj.bias' (", "model.safetensors) is "
                 "used by no weight of this spec and matches no 'ignore' pattern",
                 "add a glob pattern for it to the spec's top-level 'ignore:' list")


def test_unused_tensor_points_at_ignore(capsys, monkeypatch, tmp_path):
    spec = tmp_path / "tiny.yaml"
    text = BASE.read_text() + "\nignore:\n  - \"*.inv_freq\"\n"
    spec.write_text(text)
    line = text.splitlines().index("ignore:") + 1
    d = write_model(tmp_path / "m", tiny_shapes() | {"model.mtp.0.weight": (4,), "model.mtp.1.weight": (4,)})
    rc, out, err = build_dir(capsys, monkeypatch, tmp_path, d, spec)
    expect_error(rc, err, spec, line, "checkpoint tensor 'model.mtp.0.weight'",
                 "; also unread: 'model.mtp.1.weight'. Declare a weight")


def test_unreadable_dtype(capsys, monkeypatch, tmp_path):
    name = "model.layers.0.self_attn.o_proj.weight"
    d = write_model(tmp_path / "m", tiny_shapes(), dtypes={name: np.int8})
    rc, out, err = build_dir(capsys, monkeypatch, tmp_path, d)
    expect_error(rc, err, BASE, LINE["wo"], f"weight 'wo': checkpoint tensor '{name}' has dtype I8")


def test_sharded_checkpoint_missing_tensor(capsys, monkeypatch, tmp_path):
    """Shards with an index: the same check over every shard's header."""
    d = tmp_path / "m"
    shapes = tiny_shapes()
    names = sorted(shapes)
    write_model(d, {n: shapes[n] for n in names[:10]})
    (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
    save_file({n: np.ones(shapes[n], np.float32) for n in names[10:] if "v_proj" not in n},
              str(d / "model-00002-of-00002.safetensors"))
    index = {n: "model-00001-of-00002.safetensors" for n in names[:10]}
    index |= {n: "model-00002-of-00002.safetensors" for n in names[10:] if "v_proj" not in n}
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    rc, out, err = build_dir(capsys, monkeypatch, tmp_path, d)
    expect_error(rc, err, BASE, LINE["wv"], "checkpoint tensor 'model.layers.1.self_attn.v_proj.weight' "
                 "(layer 1) is missing")


def test_model_dir_without_spec_flag_is_checked_too(capsys, monkeypatch, tmp_path):
    """The spec found by architecture (through --spec-dir) is checked the same way."""
    sdir = tmp_path / "specs"
    sdir.mkdir()
    (sdir / "tiny.yaml").write_text(BASE.read_text())
    d = write_model(tmp_path / "m", _drop("model.norm.weight")(tiny_shapes()))
    rc, out, err = run(capsys, monkeypatch, "build", "--model-path", str(d), "--spec-dir", str(sdir),
                       "--no-compile", "--out", str(tmp_path / "out"))
    expect_error(rc, err, sdir / "tiny.yaml", LINE["final_norm"], "'model.norm.weight' is missing")


def test_checkpoint_error_end_to_end(tmp_path):
    """A real process: exit code 2, file:line, no traceback."""
    d = write_model(tmp_path / "m", _set("model.norm.weight", (65,))(tiny_shapes()))
    r = subprocess.run([sys.executable, "-m", "infc.cli", "build", "--model-path", str(d), "--spec", str(BASE),
                        "--no-compile", "--out", str(tmp_path / "out")], capture_output=True, text=True,
                       cwd=tmp_path, timeout=120, env={k: v for k, v in os.environ.items() if k != "INFC_DEBUG"})
    assert r.returncode == 2, r.stderr
    assert f"{BASE}:{LINE['final_norm']}: weight 'final_norm': checkpoint tensor 'model.norm.weight' has " \
           f"shape [65]" in r.stderr
    assert "Traceback" not in r.stderr + r.stdout


def test_llm_checks_the_checkpoint(tmp_path):
    """LLM (and so infc serve, through infc/backend.py) compiles with the same check."""
    from infc import LLM
    d = write_model(tmp_path / "m", _drop("model.layers.0.mlp.gate_proj.weight")(tiny_shapes()))
    with pytest.raises(SpecError) as e:
        LLM(d, device="cpu", spec=str(BASE))
    assert e.value.line == LINE["wg"] and "gate_proj.weight' (layer 0) is missing" in e.value.message


# ------------------------------------------------------------------ recipes, from hand-written plans

RECIPE_SPEC = """\
family: recipes
architectures: [RecipeForCausalLM]
config:
  H: hidden_size
weights:
  wq:    {name: "model.layers.{i}.qkv_proj.weight", shape: [8, 4], rows: [0, 8]}
  wk:    {name: "model.layers.{i}.qkv_proj.weight", shape: [4, 4], rows: [8, 12]}
  wt:    {name: "model.layers.{i}.conv.weight", shape: [6, 4], transpose: true}
  norm:  {name: model.norm.weight, shape: [4], offset: 1}
  we:    {name: "model.layers.{i}.experts.{e}.w1", shape: [3, 4], experts: E}
graph:
  - y = x
"""


def _recipe_setup(tmp_path, tensors: dict, weights: dict, ignore=()):
    tmp_path.mkdir(parents=True, exist_ok=True)
    spec_file = tmp_path / "recipes.yaml"
    spec_file.write_text(RECIPE_SPEC + ("ignore: [" + ", ".join(f'"{p}"' for p in ignore) + "]\n"
                                        if ignore else ""))
    d = tmp_path / "ckpt"
    d.mkdir()
    save_file({n: np.ones(s, np.float32) for n, s in tensors.items()}, str(d / "model.safetensors"))
    plan = {"schema": "infc.plan/2", "config": {"H": 4, "L": 2, "E": 2}, "weights": weights}
    return plan, load_spec(spec_file), d


QKV = {"slice": {"tensor": "model.layers.{i}.qkv_proj.weight"}, "axis": 0, "start": 0, "stop": 8}
QKV_K = {"slice": {"tensor": "model.layers.{i}.qkv_proj.weight"}, "axis": 0, "start": 8, "stop": 12}
GOOD = {"model.layers.0.qkv_proj.weight": (12, 4), "model.layers.1.qkv_proj.weight": (12, 4),
        "model.layers.0.conv.weight": (4, 6), "model.layers.1.conv.weight": (4, 6),
        "model.norm.weight": (4,)}
for _i in range(2):
    for _e in range(2):
        GOOD[f"model.layers.{_i}.experts.{_e}.w1"] = (3, 4)
WEIGHTS = {
    "wqk": {"shape": [12, 4], "dtype": "bf16", "layers": [0, 1],
            "source": {"concat": [QKV, QKV_K, {"zeros": [0, 4]}], "axis": 0}},
    "wt": {"shape": [6, 4], "dtype": "bf16", "layers": [0, 1],
           "source": {"scale": {"transpose": {"tensor": "model.layers.{i}.conv.weight"}}, "by": 0.5}},
    "norm": {"shape": [4], "dtype": "bf16", "layers": None,
             "source": {"offset": {"tensor": "model.norm.weight"}, "by": 1.0}},
    "we": {"shape": [2, 3, 4], "dtype": "bf16", "layers": [0, 1],
           "source": {"stack": "model.layers.{i}.experts.{e}.w1", "count": 2}},
}


def test_recipes_match(tmp_path):
    plan, spec, d = _recipe_setup(tmp_path, GOOD, WEIGHTS)
    assert check_model_dir(plan, spec, d) is True


RECIPE_CASES = {
    "slice_past_the_tensor": ({"model.layers.1.qkv_proj.weight": (10, 4)}, "wk",
                              "weight 'wk' (fused into 'wqk'): the spec takes rows [8, 12) of checkpoint "
                              "tensor 'model.layers.1.qkv_proj.weight', but it has 10 rows (shape [10, 4])"),
    "slice_wrong_columns": ({"model.layers.0.qkv_proj.weight": (12, 5)}, "wq",
                            "checkpoint tensor 'model.layers.0.qkv_proj.weight' has shape [12, 5], the "
                            "spec expects [>=8, 4]"),
    "transpose_not_needed": ({"model.layers.1.conv.weight": (6, 4)}, "wt",
                             "weight 'wt': checkpoint tensor 'model.layers.1.conv.weight' has shape [6, 4], "
                             "the spec expects [4, 6]"),
    "offset_norm_wrong": ({"model.norm.weight": (5,)}, "norm",
                          "checkpoint tensor 'model.norm.weight' has shape [5], the spec expects [4]"),
    "expert_missing": ({"model.layers.1.experts.1.w1": None}, "we",
                       "checkpoint tensor 'model.layers.1.experts.1.w1' (layer 1) is missing"),
    "expert_shape_differs": ({"model.layers.0.experts.1.w1": (3, 5)}, "we",
                             "checkpoint tensor 'model.layers.0.experts.1.w1' has shape [3, 5], the spec "
                             "expects [3, 4]"),
    "unused_expert": ({"model.layers.0.experts.2.w1": (3, 4)}, "we",
                      "checkpoint tensor 'model.layers.0.experts.2.w1' ("),
}


@pytest.mark.parametrize("case", sorted(RECIPE_CASES))
def test_recipe_case(case, tmp_path):
    change, weight, message = RECIPE_CASES[case]
    tensors = {k: v for k, v in (GOOD | change).items() if v is not None}
    plan, spec, d = _recipe_setup(tmp_path, tensors, WEIGHTS)
    with pytest.raises(SpecError) as e:
        check_model_dir(plan, spec, d)
    assert e.value.file == spec.path
    assert e.value.line == spec.weights[weight].line, str(e.value)
    assert message in e.value.message, e.value.message


def test_heterogeneous_layers(tmp_path):
    """plan/2 `layers`: a weight only some layers have; another layer's copy is not read."""
    weights = {"norm": WEIGHTS["norm"],
               "wt": dict(WEIGHTS["wt"], layers=[1])}
    tensors = {"model.norm.weight": (4,), "model.layers.1.conv.weight": (4, 6)}
    plan, spec, d = _recipe_setup(tmp_path, tensors, weights)
    assert check_model_dir(plan, spec, d)
    plan, spec, d = _recipe_setup(tmp_path / "b", tensors | {"model.layers.0.conv.weight": (4, 6)}, weights)
    with pytest.raises(SpecError) as e:
        check_model_dir(plan, spec, d)
    assert e.value.line == spec.weights["wt"].line
    assert ("checkpoint tensor 'model.layers.0.conv.weight' (" in e.value.message
            and "matches weight 'wt', which this configuration does not load (not at this layer"
            in e.value.message), e.value.message


def test_plan_v1_per_layer(tmp_path):
    """The check reads plan/1 (`per_layer` + config L) too."""
    weights = {"wt": {"shape": [6, 4], "dtype": "bf16", "per_layer": True,
                      "source": {"transpose": {"tensor": "model.layers.{i}.conv.weight"}}}}
    tensors = {"model.layers.0.conv.weight": (4, 6), "model.layers.1.conv.weight": (4, 6)}
    plan, spec, d = _recipe_setup(tmp_path, tensors, weights, ignore=["model.norm.*"])
    plan["schema"] = "infc.plan/1"
    assert check_model_dir(plan, spec, d)
    plan, spec, d = _recipe_setup(tmp_path / "b", {"model.layers.0.conv.weight": (4, 6)}, weights)
    with pytest.raises(SpecError, match=r"model.layers.1.conv.weight' \(layer 1\) is missing"):
        check_model_dir(plan, spec, d)


def test_slice_contradicting_the_declared_shape(tmp_path):
    """rows [0, 6) give 6 rows where the declaration says 8: named at the declaration."""
    weights = {"wq": {"shape": [8, 4], "dtype": "bf16", "layers": [0, 1],
                      "source": dict(QKV, stop=6)}}
    tensors = {"model.layers.0.qkv_proj.weight": (12, 4), "model.layers.1.qkv_proj.weight": (12, 4)}
    plan, spec, d = _recipe_setup(tmp_path, tensors, weights)
    with pytest.raises(SpecError) as e:
        check_model_dir(plan, spec, d)
    assert e.value.line == spec.weights["wq"].line
    assert ("weight 'wq': the slice [0, 6) of 'model.layers.0.qkv_proj.weight' gives shape [6, 4], but the "
            "declared shape is [8, 4]") in e.value.message, e.value.message


def test_ignore_patterns_fill_in_config_fields(tiny_model, tmp_path):
    """`ignore:` entries read config fields as weight names do: "model.layers.{L}.*" ignores an
    MTP-style layer stored past the model's own L layers, and nothing else."""
    import shutil

    from safetensors.numpy import load_file, save_file

    from infc.compiler.build import compile_model
    d, _ = tiny_model("llama")
    ck = tmp_path / "ckpt"
    shutil.copytree(d, ck)
    tensors = load_file(str(ck / "model.safetensors"))
    tensors["model.layers.3.eh_proj.weight"] = np.ones((4, 4), np.float32)
    save_file(tensors, str(ck / "model.safetensors"), metadata={"format": "pt"})
    src = open("specs/llama.yaml").read()
    ignore = '  - "model.layers.*.self_attn.rotary_emb.inv_freq"\n'
    assert ignore in src
    spec = tmp_path / "llama.yaml"
    spec.write_text(src.replace(ignore, ignore + '  - "model.layers.{L}.*"\n'))
    compile_model(spec_path=str(spec), model_dir=str(ck))          # L = 3: layer 3 is ignored
    spec.write_text(src.replace(ignore, ignore + '  - "model.layers.{V}.*"\n'))
    with pytest.raises(SpecError, match="model.layers.3.eh_proj.weight"):
        compile_model(spec_path=str(spec), model_dir=str(ck))
