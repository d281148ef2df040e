"""The GPU suite's family fixtures (tests/gpu/gpu_families.py), checked on the CPU at tiny
widths: transformers builds each family's model from the same config code the GPU machine uses,
every norm and bias comes out random (none constant), and the directory binds its spec and
passes the checkpoint check. The real-shape configs (what prepare.py builds artifacts from) bind
their specs too."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
import gpu_families  # noqa: E402

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, pad_token_id=None)


@pytest.mark.parametrize("name", list(gpu_families.FAMILIES))
def test_tiny_family_model(name, tmp_path):
    from safetensors import safe_open
    from infc.compiler.build import compile_model
    _, values = gpu_families._spec_and_values(name)
    extra = dict(TINY)
    if "head_dim" in values:
        extra["head_dim"] = 16
    if "first_k_dense_replace" in values:       # past the dense layers: two with experts
        extra["num_hidden_layers"] = values["first_k_dense_replace"] + 2
    d = gpu_families.make_model(name, tmp_path / name, device="cpu", **extra)
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        # (a one-value weight, DeepSeek-V4's hc_head.hc_scale, is constant by its shape)
        flat = [k for k in f.keys() if f.get_tensor(k).dim() == 1 and f.get_tensor(k).numel() > 1
                and bool((f.get_tensor(k) == f.get_tensor(k)[0]).all())]
    assert not flat, f"constant norms or biases: {flat}"
    compile_model(model_dir=str(d))                 # binds the spec, checks the checkpoint


@pytest.mark.parametrize("name", list(gpu_families.FAMILIES))
def test_real_config_binds(name, tmp_path):
    from infc.compiler.build import compile_model
    compile_model(model_dir=str(gpu_families.write_config(name, tmp_path)))


@pytest.mark.parametrize("name", list(gpu_families.SERVER))
def test_server_build_differs_from_the_gate_only_where_said(name, tmp_path):
    """The SDK suite's directory of a family (gpu_families.SERVER) binds its spec as the gate's cut
    does except for its overrides, and its vocabulary holds every id of the Qwen tokenizer the
    suite's text goes through."""
    import json
    spec, _ = gpu_families._spec_and_values(name)
    gate = spec.bind(json.loads((gpu_families.write_config(name, tmp_path / "gate") / "config.json").read_text()))
    extra = gpu_families.SERVER[name]
    srv = spec.bind(json.loads((gpu_families.write_config(name, tmp_path / "srv", **extra)
                                / "config.json").read_text()))
    differ = {k for k in set(gate) | set(srv) if gate.get(k) != srv.get(k)}
    assert len(differ) == len(extra) and all(srv[k] in extra.values() for k in differ), differ
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    from make_random_model import write_tokenizer
    write_tokenizer("qwen3", tmp_path / "tok", "qwen")
    ids = json.loads((tmp_path / "tok" / "tokenizer.json").read_text())
    top = max(max(ids["model"]["vocab"].values()), max(t["id"] for t in ids["added_tokens"]))
    vocab = json.loads((tmp_path / "srv" / "config.json").read_text())
    vocab = vocab.get("vocab_size") or vocab["text_config"]["vocab_size"]
    assert top < vocab, (top, vocab)


def test_prepare_stamps_the_commit(tmp_path, monkeypatch):
    """prepare.py leaves the commit it built from beside the carried configs, where session.sh
    reads it (a hash typed into a GPU command was once wrong)."""
    import subprocess
    import prepare
    monkeypatch.setattr(prepare, "GPU_CACHE", tmp_path)
    prepare.stamp_commit()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=prepare.REPO, capture_output=True,
                          text=True).stdout.strip()
    got = (tmp_path / "configs" / "COMMIT").read_text().strip()
    assert head and got in (head, head + "-dirty")
