"""tools/make_random_model.py: random-weight HF directories at a spec's shapes load in
transformers with no missing/unexpected keys, hold exactly the generated values (bf16 rounded
to nearest even), shard with an index, and are byte-for-byte deterministic per seed."""
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from exhaustive import EXHAUSTIVE

import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from infc.compiler.spec import find_variant  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def _load_tool():
    spec = importlib.util.spec_from_file_location("infc_tools_make_random_model",
                                                  REPO / "tools" / "make_random_model.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


mrm = _load_tool()

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_window_layers=2)


def tiny_qwen3(**kw):
    spec, cfg = find_variant("qwen3-0.6b")
    cfg.update(TINY)
    cfg.update(kw)
    return spec, cfg


def tiny_moe(**kw):
    spec, cfg = find_variant("qwen3-30b-a3b")
    cfg.update(TINY)
    cfg.update(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, vocab_size=1000)
    cfg.update(kw)
    return spec, cfg


def tiny_llama(**kw):
    spec, cfg = find_variant("smollm2-135m")
    cfg.update(TINY)
    cfg.update(vocab_size=1000)
    cfg.update(kw)
    return spec, cfg


def file_tensors(d: Path) -> dict:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        part = load_file(str(f))
        assert not set(part) & set(out), "a tensor appears in two files"
        out.update(part)
    return out


def load_hf(d: Path):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(d), dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"], info
    assert not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info
    assert not info["error_msgs"], info
    return model.eval()


def digest(d: Path) -> dict:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(d.iterdir()) if f.is_file()}


def check_values(files: dict, dtype: str, seed: int, planned):
    """Every file tensor equals the generator's float32 values rounded like torch does."""
    by_name = {t.name: t for t in planned}
    assert set(files) == set(by_name)
    tdt = {"bf16": torch.bfloat16, "f32": torch.float32, "f16": torch.float16}[dtype]
    for name, t in files.items():
        p = by_name[name]
        assert list(t.shape) == p.shape
        assert t.dtype == tdt
        want = torch.from_numpy(mrm.random_tensor(name, p.shape, p.kind, seed)).to(tdt)
        assert torch.equal(t, want), name


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    spec, cfg = tiny_qwen3()
    d = tmp_path_factory.mktemp("qwen3")
    mrm.write_random_model(spec, cfg, d, seed=0, dtype="bf16", tokenizer="auto")
    return d


def test_bf16_rounding_matches_torch():
    rng = np.random.default_rng(5)
    x = np.concatenate([rng.standard_normal(100000).astype(np.float32) * 10.0 ** rng.integers(-30, 30, 100000),
                        np.array([0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, 3.4e38, -3.4e38, 1e-45,
                                  1.00390625, 1.01171875, 1.0 + 2**-9, 1.0 + 3 * 2**-9],
                                 dtype=np.float32)]).astype(np.float32)
    # exact ties, both parities: halfway between two bf16 values
    ties = (rng.integers(0, 1 << 15, 1000, dtype=np.uint32) << 16) | np.uint32(0x8000)
    x = np.concatenate([x, ties.view(np.float32)])
    x = x[np.isfinite(x) | np.isinf(x)]
    bits = mrm.f32_to_bf16_bits(x)
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(bits, want)
    nan = mrm.f32_to_bf16_bits(np.array([np.nan], np.float32))
    assert torch.isnan(torch.from_numpy(nan.view(np.int16)).view(torch.bfloat16)).all()


def test_qwen3_loads_and_equals_files(qwen3_dir):
    spec, cfg = tiny_qwen3()
    files = file_tensors(qwen3_dir)
    check_values(files, "bf16", 0, mrm.plan_tensors(spec, cfg))
    assert "lm_head.weight" not in files            # tie_word_embeddings: true
    assert len(files) == 2 + 2 * 11                  # embed, final norm, 11 per layer
    model = load_hf(qwen3_dir)
    sd = model.state_dict()
    assert set(sd) == set(files) | {"lm_head.weight"}
    for k, v in files.items():
        assert torch.equal(sd[k], v.float()), k
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    cfg_json = json.loads((qwen3_dir / "config.json").read_text())
    assert cfg_json["architectures"] == ["Qwen3ForCausalLM"]
    assert cfg_json["model_type"] == "qwen3" and cfg_json["torch_dtype"] == "bfloat16"
    assert model.config.num_hidden_layers == 2 and model.config.head_dim == 16
    gen = json.loads((qwen3_dir / "generation_config.json").read_text())
    assert gen == {"bos_token_id": 151643, "eos_token_id": 151645}


def test_qwen3_logits_not_degenerate(qwen3_dir):
    model = load_hf(qwen3_dir)
    tok = transformers.AutoTokenizer.from_pretrained(str(qwen3_dir))
    ids = tok("The capital of France is Paris, and 東京 is", return_tensors="pt")["input_ids"]
    assert ids.shape[1] > 5
    with torch.no_grad():
        logits = model(ids).logits[0]
    assert torch.isfinite(logits).all()
    assert logits.std(dim=-1).min() > 0.05                  # not flat over the vocab
    assert logits.argmax(-1).unique().numel() > 1           # not the same token everywhere
    probs = logits.softmax(-1)
    assert probs.max() < 0.5                                # no single token dominates


def test_qwen3_untied_f32(tmp_path):
    spec, cfg = tiny_qwen3(tie_word_embeddings=False, vocab_size=1000)
    mrm.write_random_model(spec, cfg, tmp_path, seed=3, dtype="f32", tokenizer=None)
    assert not (tmp_path / "tokenizer.json").exists()
    files = file_tensors(tmp_path)
    check_values(files, "f32", 3, mrm.plan_tensors(spec, cfg, "f32"))
    assert not torch.equal(files["lm_head.weight"], files["model.embed_tokens.weight"])
    model = load_hf(tmp_path)
    sd = model.state_dict()
    assert set(sd) == set(files)
    for k, v in files.items():
        assert torch.equal(sd[k], v), k
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "float32"


def test_qwen3_moe_loads_and_equals_files(tmp_path):
    """transformers 5 loads per-expert checkpoint tensors into fused 3-D parameters:
    experts.gate_up_proj [E, 2*Fe, H] = stack_e(cat(gate_e, up_e)), experts.down_proj [E, H, Fe];
    save_pretrained writes per-expert names back."""
    spec, cfg = tiny_moe()
    mrm.write_random_model(spec, cfg, tmp_path, seed=1, dtype="bf16", tokenizer=None)
    files = file_tensors(tmp_path)
    check_values(files, "bf16", 1, mrm.plan_tensors(spec, cfg))
    E, L = 8, 2
    assert sum(".experts." in k for k in files) == L * E * 3
    model = load_hf(tmp_path)
    sd = model.state_dict()
    used = set()
    for k, v in sd.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            p = k[: -len("gate_up_proj")]
            names = [f"{p}{e}.{w}.weight" for e in range(E) for w in ("gate_proj", "up_proj")]
            want = torch.stack([torch.cat([files[f"{p}{e}.gate_proj.weight"],
                                           files[f"{p}{e}.up_proj.weight"]], 0)
                                for e in range(E)]).float()
            assert v.shape == (E, 2 * 32, 64)
        elif k.endswith("mlp.experts.down_proj"):
            p = k[: -len("down_proj")]
            names = [f"{p}{e}.down_proj.weight" for e in range(E)]
            want = torch.stack([files[n] for n in names]).float()
            assert v.shape == (E, 64, 32)
        else:
            names, want = [k], files[k].float()
        assert torch.equal(v, want), k
        used.update(names)
    assert used == set(files)
    with torch.no_grad():
        logits = model(torch.tensor([[1, 5, 900, 17, 42]])).logits
    assert torch.isfinite(logits).all() and logits.std() > 0.05

    saved = tmp_path / "saved"
    model.save_pretrained(str(saved))
    back = file_tensors(saved)
    assert set(back) == set(files)              # per-expert names again
    for k, v in files.items():
        assert torch.equal(back[k].float(), v.float()), k


def test_llama_loads(tmp_path):
    spec, cfg = tiny_llama()
    mrm.write_random_model(spec, cfg, tmp_path, seed=0, tokenizer=None)
    files = file_tensors(tmp_path)
    check_values(files, "bf16", 0, mrm.plan_tensors(spec, cfg))
    model = load_hf(tmp_path)
    assert type(model).__name__ == "LlamaForCausalLM"
    sd = model.state_dict()
    for k, v in files.items():
        assert torch.equal(sd[k], v.float()), k


def test_sharded_index(tmp_path):
    spec, cfg = tiny_qwen3(tie_word_embeddings=False, vocab_size=1000)
    one, many = tmp_path / "one", tmp_path / "many"
    mrm.write_random_model(spec, cfg, one, seed=2, tokenizer=None)
    info = mrm.write_random_model(spec, cfg, many, seed=2, tokenizer=None, max_shard_bytes=100_000)
    assert len(info["files"]) > 2
    assert not (one / "model.safetensors.index.json").exists()
    index = json.loads((many / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(info["files"])
    for f in info["files"]:
        assert (many / f).stat().st_size <= 100_000 + 4096 or len(load_file(str(many / f))) == 1
    files = file_tensors(many)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in files.values())
    for name, f in index["weight_map"].items():
        assert name in load_file(str(many / f))
    ref = file_tensors(one)
    assert set(ref) == set(files) and all(torch.equal(ref[k], files[k]) for k in ref)
    sd = load_hf(many).state_dict()
    for k, v in files.items():
        assert torch.equal(sd[k], v.float()), k
    # Rewriting unsharded into the sharded directory leaves no stale shards behind.
    mrm.write_random_model(spec, cfg, many, seed=2, tokenizer=None)
    assert sorted(p.name for p in many.glob("*.safetensors")) == ["model.safetensors"]
    assert not (many / "model.safetensors.index.json").exists()


def test_deterministic(tmp_path):
    spec, cfg = tiny_moe()
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    mrm.write_random_model(spec, cfg, a, seed=7, tokenizer=None)
    mrm.write_random_model(spec, cfg, b, seed=7, tokenizer=None, workers=1)
    mrm.write_random_model(spec, cfg, c, seed=8, tokenizer=None)
    assert digest(a) == digest(b)
    assert digest(a)["model.safetensors"] != digest(c)["model.safetensors"]
    assert digest(a)["config.json"] == digest(c)["config.json"]


def test_cli_small_variant_plan():
    """The variant's exact shapes (no weights written): qwen3-0.6b and qwen3-30b-a3b."""
    spec, cfg = find_variant("qwen3-0.6b")
    plan = mrm.plan_tensors(spec, cfg)
    assert sum(t.numel for t in plan) == 596_049_920       # Qwen3-0.6B, tied embeddings
    assert plan[0].name == "model.embed_tokens.weight" and plan[0].shape == [151936, 1024]
    spec, cfg = find_variant("qwen3-30b-a3b")
    plan = mrm.plan_tensors(spec, cfg)
    assert sum(t.numel for t in plan) == 30_532_122_624    # Qwen3-30B-A3B
    assert len(mrm.shard(plan, mrm.MAX_SHARD_BYTES)) == 16


@pytest.mark.slow
@EXHAUSTIVE      # 1.2 GB written at a real variant's shapes; test_cli_small_variant_plan runs the CLI fast
def test_cli_qwen3_0_6b(tmp_path):
    out = tmp_path / "qwen3-0.6b"
    t0 = time.time()
    subprocess.run([sys.executable, str(REPO / "tools" / "make_random_model.py"),
                    "--model", "qwen3-0.6b", "--out", str(out)], check=True)
    print(f"qwen3-0.6b written in {time.time() - t0:.1f}s")
    assert (out / "model.safetensors").stat().st_size > 1.19e9
    model = load_hf(out)
    assert sum(p.numel() for p in model.parameters()) == 596_049_920
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert tok.eos_token_id == 151645


def test_llama_smollm2_tokenizer(tmp_path):
    spec, cfg = tiny_llama(vocab_size=49152)
    info = mrm.write_random_model(spec, cfg, tmp_path, seed=0, tokenizer="auto")
    assert info["tokenizer"] == "smollm2"
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert len(tok) == 49152
    ids = tok("Hello world", return_tensors="pt")["input_ids"]
    model = load_hf(tmp_path)
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()
