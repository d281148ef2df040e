"""More malformed inputs, each a case that ended in a traceback, a hang, an allocation of
gigabytes or silently wrong numbers: now a clear error naming the file and the line, key or
tensor (exit 2 through `infc build`; SpecError / ModelDirError / ValueError through the API).

Spec YAML (compiler/yaml_lines.py, compiler/spec.py): nesting thousands deep, a list as a mapping
key, aliases of aliases (billion laughs) bound to a symbol, a 5000-digit integer, bytes that are
not UTF-8, a FIFO where a spec is read; spec fields of the wrong type (architectures, weight
name / tied_to / when / experts / dtype, requires entries, statements without their line),
symbols named as the language's constants or indices, a requirement that is a value and not a
condition, keyword arguments to config functions (int('10', base=16) was 10), two specs of one
user directory claiming one architecture or variant. Lowering (compiler/lower.py,
compiler/passes/infer_types.py, compiler/ops/): layers(...) inside the layer graph, no `logits`,
logits of every token, a kind expression that is not a name, op attributes of the wrong type,
a norm eps that is negative or missing, rope parameters that are 0 / negative / strings (NaN
frequencies), and a huge head_dim whose rope check allocated GBs.

config.json and the model directory (compiler/build.py, compiler/contract/): JSON nested too
deeply or with a 5000-digit integer (config.json, safetensors header, index), a header dtype
that is a list, num_hidden_layers 10**6 (linear build time), a negative context length, one
tensor in two shards with no index, FIFOs; tokenizer_config.json and generation_config.json
(runtime/tokenization/tokenizer.py) broken or with ids of the wrong type (a string eos never
stops generation); the CPU backend's weights larger than the machine's memory (infc/backend.py).
"""
import json
import os
import shutil
import struct
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from safetensors.numpy import save_file
from test_checkpoint_honesty import BASE, TINY, build_dir, run, tiny_shapes, write_model

from infc.compiler.contract.errors import ModelDirError, SpecError
from infc.compiler.spec import SPECS_DIR, find_architecture, find_variant, load_spec

TEXT = BASE.read_text()
LAYER_WQ = '    wq:        {name: "model.layers.{i}.self_attn.q_proj.weight", shape: [Hq*D, H]}'


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv("INFC_SPEC_PATH", raising=False)
    monkeypatch.delenv("INFC_DEBUG", raising=False)


def spec_with(tmp_path, old: str, new: str, name="spec.yaml") -> Path:
    assert old in TEXT, old
    p = tmp_path / name
    p.write_text(TEXT.replace(old, new, 1))
    return p


def build_spec(capsys, monkeypatch, tmp_path, spec: Path, model="tiny"):
    return run(capsys, monkeypatch, "build", "--spec", str(spec), "--model", model, "--no-compile",
               "--out", str(tmp_path / "out"))


def expect(rc, err, where: str, *parts):
    assert rc == 2, err
    assert err.startswith(f"error: {where}"), err
    for p in parts:
        assert p in err, err


# ------------------------------------------------------------------ the YAML itself

@pytest.mark.parametrize("text", ["a: " + "[" * 5000 + "]" * 5000 + "\n",
                                  "a: " + "{b: " * 3000 + "1" + "}" * 3000 + "\n"], ids=["list", "mapping"])
def test_yaml_nested_too_deeply(capsys, monkeypatch, tmp_path, text):
    p = tmp_path / "deep.yaml"
    p.write_text(text)
    rc, out, err = build_spec(capsys, monkeypatch, tmp_path, p)
    expect(rc, err, f"{p}: ", "YAML nested too deeply")


def test_yaml_list_as_mapping_key(capsys, monkeypatch, tmp_path):
    p = spec_with(tmp_path, "  H: hidden_size", "  [a, b]: hidden_size\n  H: hidden_size")
    rc, out, err = build_spec(capsys, monkeypatch, tmp_path, p)
    expect(rc, err, f"{p}:6: ", "a mapping key must be a name or number, got a list ['a', 'b']")


def test_yaml_alias_bomb_bound_to_a_symbol_is_refused_at_once(capsys, monkeypatch, tmp_path):
    """Nine levels of ten aliases: 10**9 nodes that the config value's checks walked (a hang)."""
    anchors = ["x0: &a0 [1,1,1,1,1,1,1,1,1,1]"] + [
        f"x{i}: &a{i} [{','.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    p = spec_with(tmp_path, "variants:\n  tiny: {", "variants:\n  tiny: {" + ", ".join(anchors) + ", ")
    p.write_text(p.read_text().replace("rope_theta: 10000,", "rope_theta: *a8,"))
    t0 = time.perf_counter()
    rc, out, err = build_spec(capsys, monkeypatch, tmp_path, p)
    assert time.perf_counter() - t0 < 10
    expect(rc, err, f"{p}:", "the YAML expands to more than 1,000,000 nodes")


def test_yaml_integer_of_5000_digits(capsys, monkeypatch, tmp_path):
    p = spec_with(tmp_path, "hidden_size: 64,", "hidden_size: " + "9" * 5000 + ",")
    rc, out, err = build_spec(capsys, monkeypatch, tmp_path, p)
    expect(rc, err, f"{p}: ", "YAML error: Exceeds the limit (4300 digits)")


def test_spec_that_is_not_utf8(capsys, monkeypatch, tmp_path):
    p = tmp_path / "bin.yaml"
    p.write_bytes(b"family: \xff\xfe\n")
    rc, out, err = build_spec(capsys, monkeypatch, tmp_path, p)
    expect(rc, err, f"{p}: ", "cannot read spec: not UTF-8 text (byte 8")


# ------------------------------------------------------------------ spec fields of the wrong type

FIELD_CASES = {
    # case -> (old, new, line, message)
    "architectures_not_names": ("architectures: [TinyForCausalLM]", "architectures: [1, [a]]", 3,
                                "'architectures' must be a list of class names like [Qwen3ForCausalLM], "
                                "got [1, ['a']]"),
    "symbol_named_none": ("  tie: tie_word_embeddings = false",
                          "  none: hidden_size\n  tie: tie_word_embeddings = false", 15,
                          "symbol 'none' is reserved (a constant in spec expressions)"),
    "symbol_named_i": ("  tie: tie_word_embeddings = false",
                       "  i: hidden_size\n  tie: tie_word_embeddings = false", 15,
                       "symbol 'i' is reserved (the layer index in spec expressions)"),
    "symbol_not_identifier": ("  tie: tie_word_embeddings = false",
                              "  tie-x: hidden_size\n  tie: tie_word_embeddings = false", 15,
                              "symbol 'tie-x' must be an identifier"),
    "requires_number": ('  - act == "silu"', "  - 1", 19,
                        "'requires' entry 1 must be a condition like 'act == \"silu\"', got 1"),
    "requires_empty": ('  - act == "silu"', "  -", 19,
                       "'requires' entry 1 must be a condition like 'act == \"silu\"', got None"),
    "requires_a_value": ('  - act == "silu"', "  - act", 19,
                         "requirement 'act' is 'silu' in "),
    "requires_always_true_list": ('  - act == "silu"', "  - '[1]'", 19,
                                  "requirement '[1]' is [1] in "),
    "weight_name_null": ("  embed:      {name: model.embed_tokens.weight, shape: [V, H]}",
                         "  embed:      {name: , shape: [V, H]}", 27,
                         "weight 'embed': 'name' must be the checkpoint tensor's name (a non-empty "
                         "string), got None"),
    "weight_name_number": ("  embed:      {name: model.embed_tokens.weight, shape: [V, H]}",
                           "  embed:      {name: 5, shape: [V, H]}", 27, "got 5"),
    "or_name_null": (LAYER_WQ, LAYER_WQ[:-1] + ", or: {name: ~}}", 34,
                     "weight 'wq': 'name' must be the checkpoint tensor's name"),
    "tied_to_list": ("tied_to: embed, when: tie", "tied_to: [embed], when: tie", 29,
                     "weight 'lm_head': 'tied_to' must name another weight, got ['embed']"),
    "when_list": ("tied_to: embed, when: tie", "tied_to: embed, when: [tie]", 29,
                  "weight 'lm_head': 'when' must name a config symbol, got ['tie']"),
    "experts_list": ("  embed:      {name: model.embed_tokens.weight, shape: [V, H]}",
                     "  embed:      {name: model.embed_tokens.weight, shape: [V, H], experts: [E]}", 27,
                     "weight 'embed': 'experts' must name the config symbol of the expert count"),
    "dtype_list": ("  embed:      {name: model.embed_tokens.weight, shape: [V, H]}",
                   "  embed:      {name: model.embed_tokens.weight, shape: [V, H], dtype: [bf16]}", 27,
                   "weight 'embed': 'dtype' must name a dtype, got ['bf16']"),
    "statement_a_number": ("  - x = embedding(tokens, embed)", "  - x = embedding(tokens, embed)\n  - 5", 54,
                           "statement in 'graph' must be a string 'name = op(...)'"),
    "keyword_to_a_config_function": ("  D: head_dim = H // Hq", "  D: head_dim = int('16', base=8)", 10,
                                     "default of D: int() takes no keyword arguments"),
    # lowering
    "layers_inside_the_layer_graph": ("    - h = rms_norm(x, attn_norm, eps)\n",
                                      "    - h = rms_norm(x, attn_norm, eps)\n    - x = layers(x)\n", 44,
                                      "the layer graph itself cannot call it"),
    "no_logits": ("  - logits = linear(rms_norm(last(x), final_norm, eps), lm_head)",
                  "  - y = linear(rms_norm(last(x), final_norm, eps), lm_head)", 55,
                  "the graph's last statement assigns y, not 'logits'"),
    "logits_of_every_token": ("  - logits = linear(rms_norm(last(x), final_norm, eps), lm_head)",
                              "  - logits = linear(rms_norm(x, final_norm, eps), lm_head)", 55,
                              "logits must be one row per sequence, [B, vocab]"),
    "kind_expression_not_a_name": ("layer:\n  weights:",
                                   "layer:\n  kind: '[1]'\n  kinds:\n    a: {}\n  weights:", 32,
                                   "layer 0: the kind expression gives [1], not the name of a kind"),
    "rope_theta_a_string": ("rope(q, theta), rope(k, theta)", "rope(q, 'x'), rope(k, theta)", 47,
                            "rope: theta (the config's rope_theta) must be a positive number, got 'x'"),
    "rope_scaling_a_list": ("rope(q, theta), rope(k, theta)", "rope(q, theta, [1]), rope(k, theta)", 47,
                            "rope: scaling (the config's rope_scaling) must be an object"),
    "attention_scale_a_string": ("rope(k, theta), v)", "rope(k, theta), v, scale='x')", 47,
                                 "attention: an attribute has the wrong type or value"),
    "attention_window_a_string": ("rope(k, theta), v)", "rope(k, theta), v, window='a')", 47,
                                  "attention: an attribute has the wrong type or value"),
    "norm_eps_negative": ("    - h = rms_norm(x, attn_norm, eps)", "    - h = rms_norm(x, attn_norm, -1.0)", 43,
                          "rms_norm: eps must be a number >= 0 (the config's norm epsilon), got -1.0"),
    "norm_eps_none": ("    - h = rms_norm(x, attn_norm, eps)", "    - h = rms_norm(x, attn_norm, none)", 43,
                      "rms_norm: eps must be a number >= 0"),
    "norm_eps_a_string": ("    - h = rms_norm(x, attn_norm, eps)", "    - h = rms_norm(x, attn_norm, 'x')", 43,
                          "rms_norm: eps must be a number >= 0"),
}


@pytest.mark.parametrize("case", sorted(FIELD_CASES))
def test_spec_field_of_the_wrong_kind(case, capsys, monkeypatch, tmp_path):
    old, new, line, message = FIELD_CASES[case]
    p = spec_with(tmp_path, old, new)
    rc, out, err = build_spec(capsys, monkeypatch, tmp_path, p)
    expect(rc, err, f"{p}:{line}: ", message)
    assert not (tmp_path / "out").exists()


def test_two_specs_of_one_directory_claiming_one_architecture(capsys, monkeypatch, tmp_path):
    d = tmp_path / "specs"
    d.mkdir()
    (d / "a.yaml").write_text(TEXT.replace("family: tiny", "family: tiny_a"))
    (d / "b.yaml").write_text(TEXT.replace("family: tiny", "family: tiny_b"))
    m = write_model(tmp_path / "m", tiny_shapes())
    with pytest.raises(SpecError, match="architecture 'TinyForCausalLM' is claimed by two specs in .*: "
                                        "a.yaml and b.yaml") as e:
        find_architecture(["TinyForCausalLM"], [d])
    assert e.value.file == str(d / "b.yaml") and e.value.line == 3
    with pytest.raises(SpecError, match="variant 'tiny' is claimed by two specs"):
        find_variant("tiny", [d])
    rc, out, err = run(capsys, monkeypatch, "build", "--model-path", str(m), "--spec-dir", str(d),
                       "--no-compile", "--out", str(tmp_path / "out"))
    expect(rc, err, f"{d / 'b.yaml'}:3: ", "is claimed by two specs")
    # across directories the first directory still wins, as documented
    other = tmp_path / "other"
    other.mkdir()
    shutil.move(d / "b.yaml", other / "b.yaml")
    assert find_architecture(["TinyForCausalLM"], [d, other]).family == "tiny_a"


def test_builtin_specs_claim_each_architecture_and_variant_once():
    """specs/ is searched only up to its first match (no build loads every spec): so each
    architecture and variant must be claimed by one built-in spec."""
    archs, variants = {}, {}
    for f in sorted(SPECS_DIR.glob("*.yaml")):
        s = load_spec(f)
        for a in s.architectures:
            assert a not in archs, f"{a}: {archs.get(a)} and {f.name}"
            archs[a] = f.name
        for v in s.variants:
            assert v not in variants, f"{v}: {variants.get(v)} and {f.name}"
            variants[v] = f.name


# ------------------------------------------------------------------ config.json values

def model_with(tmp_path, **config) -> Path:
    return write_model(tmp_path / "m", tiny_shapes(), config)


RAW_CONFIGS = {
    "nested_too_deeply": ('{"a": ' + "[" * 100000 + "]" * 100000 + "}", "invalid JSON: nested too deeply"),
    "integer_of_5000_digits": ('{"hidden_size": ' + "9" * 5000 + "}",
                               "invalid JSON: Exceeds the limit (4300 digits)"),
    "not_utf8": (b'{"a": "\xff"}', "not UTF-8 text (byte 7"),
}


@pytest.mark.parametrize("case", sorted(RAW_CONFIGS))
def test_config_json_that_json_cannot_read(case, capsys, monkeypatch, tmp_path):
    text, message = RAW_CONFIGS[case]
    d = model_with(tmp_path)
    cfg = d / "config.json"
    cfg.write_bytes(text if isinstance(text, bytes) else text.encode())
    rc, out, err = build_dir(capsys, monkeypatch, tmp_path, d)
    expect(rc, err, f"{cfg}: ", message)


def test_a_million_layers_is_refused_at_once(capsys, monkeypatch, tmp_path):
    """Was 30 s of lowering before the checkpoint check failed (2**31 - 1: days)."""
    d = model_with(tmp_path, num_hidden_layers=10**6)
    t0 = time.perf_counter()
    rc, out, err = build_dir(capsys, monkeypatch, tmp_path, d)
    assert time.perf_counter() - t0 < 10
    expect(rc, err, f"{d / 'config.json'}:7: ", "config key 'num_hidden_layers'",
           "1000000 layers is more than infc builds (4096")


ROPE_CASES = {
    "factor_zero": ({"rope_scaling": {"rope_type": "linear", "factor": 0}},
                    "rope_scaling's 'factor' must be a positive number, got 0"),
    "factor_negative": ({"rope_scaling": {"rope_type": "linear", "factor": -2.0}},
                        "rope_scaling's 'factor' must be a positive number, got -2.0"),
    "factor_a_string": ({"rope_scaling": {"rope_type": "linear", "factor": "2"}},
                        "rope_scaling's 'factor' must be a positive number, got '2'"),
    "yarn_beta_a_string": ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "beta_fast": "x",
                                             "original_max_position_embeddings": 128}},
                           "rope_scaling's 'beta_fast' must be a number, got 'x'"),
    "yarn_original_length_zero": ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                    "original_max_position_embeddings": 0}},
                                  "'original_max_position_embeddings' must be a positive number"),
    "partial_factor_over_one": ({"rope_scaling": {"rope_type": "default", "partial_rotary_factor": 2}},
                                "'partial_rotary_factor' must be a number in (0, 1], got 2"),
    "theta_zero": ({"rope_theta": 0}, "rope: theta (the config's rope_theta) must be a positive number, got 0"),
    "theta_negative": ({"rope_theta": -1.0}, "must be a positive number, got -1.0"),
}


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_rope_parameters_it_cannot_compute_with(case, capsys, monkeypatch, tmp_path):
    """0 and negative values were accepted (NaN or infinite frequencies: garbage logits), strings
    ended in a TypeError inside numpy."""
    config, message = ROPE_CASES[case]
    spec = spec_with(tmp_path, "  theta: rope_theta", "  theta: rope_theta\n  scaling: rope_scaling = none")
    spec.write_text(spec.read_text().replace("rope(q, theta), rope(k, theta)",
                                             "rope(q, theta, scaling), rope(k, theta, scaling)"))
    d = model_with(tmp_path, **config)
    rc, out, err = build_dir(capsys, monkeypatch, tmp_path, d, spec)
    expect(rc, err, f"{spec}:48: ", "rope: ", message)


def test_a_huge_head_dim_allocates_nothing_to_check_rope(capsys, monkeypatch, tmp_path):
    """The rope check computed head_dim / 2 frequencies per rope node: GBs at head_dim 2**29."""
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["TinyForCausalLM"], **TINY,
                                               "head_dim": 2**26}))
    tracemalloc.start()
    try:
        rc, out, err = build_dir(capsys, monkeypatch, tmp_path, d)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert rc == 0, err                # a config-only directory: the plan is built ...
    assert peak < 64 << 20, peak       # ... without an array of 2**25 frequencies (256 MB each)


def test_a_negative_context_length(capsys, monkeypatch, tmp_path):
    spec = spec_with(tmp_path, "  theta: rope_theta", "  theta: rope_theta\n  max_len: max_position_embeddings")
    d = model_with(tmp_path, max_position_embeddings=-1)
    rc, out, err = build_dir(capsys, monkeypatch, tmp_path, d, spec)
    expect(rc, err, f"{d / 'config.json'}:", "config key 'max_position_embeddings' must not be negative")


# ------------------------------------------------------------------ checkpoint files

def _header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def test_safetensors_header_nested_too_deeply(capsys, monkeypatch, tmp_path):
    d = model_with(tmp_path)
    f = d / "model.safetensors"
    h = b"[" * 100000 + b"]" * 100000
    f.write_bytes(struct.pack("<Q", len(h)) + h)
    rc, out, err = build_dir(capsys, monkeypatch, tmp_path, d)
    expect(rc, err, f"{f}: ", "the header is not valid UTF-8 JSON (nested too deeply)")


def test_safetensors_dtype_that_is_a_list(capsys, monkeypatch, tmp_path):
    d = model_with(tmp_path)
    f = d / "model.safetensors"
    header, data = _header(f)
    header["model.norm.weight"]["dtype"] = ["F32"]
    h = json.dumps(header).encode()
    f.write_bytes(struct.pack("<Q", len(h)) + h + data)
    rc, out, err = build_dir(capsys, monkeypatch, tmp_path, d)
    expect(rc, err, f"{f}: ", "tensor 'model.norm.weight' has unknown dtype ['F32']")


def test_index_nested_too_deeply(capsys, monkeypatch, tmp_path):
    d = model_with(tmp_path)
    index = d / "model.safetensors.index.json"
    index.write_text('{"weight_map": ' + "[" * 100000 + "]" * 100000 + "}")
    rc, out, err = build_dir(capsys, monkeypatch, tmp_path, d)
    expect(rc, err, f"{index}: ", "invalid index (JSON nested too deeply)")


def test_one_tensor_in_two_shards_without_an_index(capsys, monkeypatch, tmp_path):
    """The later file silently won: a stale copy's weights were the model's."""
    d = model_with(tmp_path)
    save_file({"model.norm.weight": np.full(64, 5.0, np.float32)}, str(d / "zz-stale.safetensors"))
    rc, out, err = build_dir(capsys, monkeypatch, tmp_path, d)
    expect(rc, err, f"{d}: ", "tensor 'model.norm.weight' is in both model.safetensors and "
                              "zz-stale.safetensors, and no model.safetensors.index.json says which")


@pytest.mark.parametrize("where", ["spec", "spec_dir", "config", "index"])
def test_a_fifo_is_refused_not_read(where, tmp_path):
    """Reading a FIFO blocks until a writer comes: the command hung. A real process with a
    timeout, so that a regression fails here instead of hanging the suite."""
    d = model_with(tmp_path)
    fifo_at = {"spec": tmp_path / "fifo.yaml", "spec_dir": tmp_path / "specs" / "a.yaml",
               "config": d / "config.json", "index": d / "model.safetensors.index.json"}[where]
    fifo_at.parent.mkdir(exist_ok=True)
    if fifo_at.exists():
        fifo_at.unlink()
    os.mkfifo(fifo_at)
    args = {"spec": ["--spec", str(fifo_at), "--model", "tiny"],
            "spec_dir": ["--model", "tiny", "--spec-dir", str(fifo_at.parent)],
            "config": ["--model-path", str(d), "--spec", str(BASE)],
            "index": ["--model-path", str(d), "--spec", str(BASE)]}[where]
    r = subprocess.run([sys.executable, "-m", "infc.cli", "build", *args, "--no-compile", "--out",
                        str(tmp_path / "out")], capture_output=True, text=True, timeout=60,
                       env={k: v for k, v in os.environ.items() if k != "INFC_DEBUG"})
    assert r.returncode == 2, r.stderr
    assert f"error: {fifo_at}" in r.stderr and "not a regular file" in r.stderr, r.stderr


# ------------------------------------------------------------------ tokenizer and generation config

@pytest.fixture(scope="module")
def tok_src(tmp_path_factory):
    from grammar_fixtures import small_tokenizer
    d = tmp_path_factory.mktemp("tok")
    small_tokenizer(d)
    return d


def tok_dir(tmp_path, tok_src, files: dict) -> Path:
    d = tmp_path / "tok"
    shutil.copytree(tok_src, d)
    for name, content in files.items():
        (d / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    return d


TOKENIZER_CONFIGS = {
    "not_json": ("{nope", "tokenizer_config.json:1: invalid JSON"),
    "a_list": ("[1]", "tokenizer_config.json: a JSON list, not an object"),
    "null": ("null", "tokenizer_config.json: a JSON null, not an object"),
    "nested_too_deeply": ("[" * 100000 + "]" * 100000, "tokenizer_config.json: invalid JSON: nested too deeply"),
    "not_utf8": (b'{"a": "\xff"}', "tokenizer_config.json: not UTF-8 text"),
    "bos_a_list": ('{"bos_token": ["<eos>"], "add_bos_token": true}', "'bos_token' must be a token string"),
    "bos_a_number": ('{"bos_token": 1, "add_bos_token": true}', "'bos_token' must be a token string"),
}


@pytest.mark.parametrize("case", sorted(TOKENIZER_CONFIGS))
def test_broken_tokenizer_config(case, tmp_path, tok_src, monkeypatch):
    from infc.runtime.tokenization.tokenizer import Tokenizer
    monkeypatch.setenv("INFC_TOKENIZER_CACHE", str(tmp_path / "facts"))
    text, message = TOKENIZER_CONFIGS[case]
    d = tok_dir(tmp_path, tok_src, {"tokenizer_config.json": text})
    with pytest.raises(ModelDirError) as e:
        Tokenizer(d)
    assert str(e.value).startswith(str(d / "tokenizer_config.json")) and message in str(e.value), e.value


def test_tokenizer_config_bos_without_content_adds_none(tmp_path, tok_src, monkeypatch):
    from infc.runtime.tokenization.tokenizer import Tokenizer
    monkeypatch.setenv("INFC_TOKENIZER_CACHE", str(tmp_path / "facts"))
    d = tok_dir(tmp_path, tok_src, {"tokenizer_config.json": '{"bos_token": {"x": 1}, "add_bos_token": true}'})
    assert Tokenizer(d).bos_id is None           # was a KeyError: 'content'


GENERATION_CONFIGS = {
    "not_json": ("{nope", ":1: invalid JSON"),
    "a_list": ("[1]", ": a JSON list, not an object"),
    "nested_too_deeply": ("[" * 100000 + "]" * 100000, ": invalid JSON: nested too deeply"),
    "eos_a_string": ('{"eos_token_id": "2"}', ":1: 'eos_token_id' must be a token id or a list of them"),
    "eos_strings": ('{"eos_token_id": ["2", 3]}', "'eos_token_id' must be a token id"),
    "eos_nested": ('{"eos_token_id": [[1]]}', "'eos_token_id' must be a token id"),
    "eos_an_object": ('{"eos_token_id": {"a": 1}}', "'eos_token_id' must be a token id"),
    "eos_a_boolean": ('{"eos_token_id": true}', "'eos_token_id' must be a token id"),
    "eos_negative": ('{"eos_token_id": -1}', "'eos_token_id' must be a token id"),
}


@pytest.mark.parametrize("case", sorted(GENERATION_CONFIGS))
def test_broken_generation_config(case, tmp_path):
    """A broken generation_config.json was skipped (config.json's eos used instead), a string eos
    never matched a sampled id (generation never stopped), and a list or an object raised."""
    from infc.runtime.tokenization.tokenizer import eos_ids
    text, message = GENERATION_CONFIGS[case]
    d = tmp_path / "m"
    d.mkdir()
    (d / "generation_config.json").write_text(text)
    (d / "config.json").write_text('{"eos_token_id": 2}')
    with pytest.raises(ModelDirError) as e:
        eos_ids(d)
    assert str(e.value).startswith(f"{d / 'generation_config.json'}") and message in str(e.value), e.value


def test_generation_config_that_is_a_directory(tmp_path):
    from infc.runtime.tokenization.tokenizer import eos_ids
    (tmp_path / "generation_config.json").mkdir()
    with pytest.raises(ModelDirError, match="generation_config.json: not a regular file"):
        eos_ids(tmp_path)


def test_valid_eos_ids(tmp_path):
    from infc.runtime.tokenization.tokenizer import eos_ids
    (tmp_path / "config.json").write_text('{"eos_token_id": [1, 2]}')
    assert eos_ids(tmp_path) == {1, 2}
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": 7, "temperature": 0.6}')
    assert eos_ids(tmp_path) == {7}


def test_eagle3_head_config_that_is_a_list(tmp_path):
    from infc.backend import eagle3_layers
    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text("[1]")
    with pytest.raises(ModelDirError, match="config.json: a JSON list, not an object"):
        eagle3_layers(SimpleNamespace(model=str(head)), tmp_path)


# ------------------------------------------------------------------ the CPU backend's memory

def test_cpu_weights_larger_than_memory_are_refused_before_allocating(tmp_path, monkeypatch):
    """--load-format dummy with vocab_size 2**31 - 1: 512 GiB of float32 weights. numpy's
    MemoryError (an internal error) or the kernel's OOM killer came first."""
    from infc import LLM
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["TinyForCausalLM"], **TINY,
                                               "vocab_size": 2**31 - 1}))
    real = os.sysconf
    monkeypatch.setattr(os, "sysconf", lambda k: 2**18 if k == "SC_PHYS_PAGES" else real(k))  # 1 GiB
    with pytest.raises(ValueError, match=r"the CPU backend holds the weights in float32, 512.0 GiB .* "
                                         r"more than this machine's 1.0 GiB of memory"):
        LLM(d, device="cpu", spec=str(BASE), load_format="dummy")
