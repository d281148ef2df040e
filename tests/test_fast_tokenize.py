"""runtime/tokenization/fast_tokenize.py: long prompts split at proven pre-token boundaries, encoded in
parallel and from a piece cache, give exactly the ids of the tokenizers library's own `encode`
(special tokens included) on the Qwen and SmolLM2 fixtures, on their regex variants, and on
SentencePiece/Metaspace-style tokenizers built here; the fast path is on where the rule holds
(and is checked to be taken), off where it cannot be justified, and the load-time probe turns it
off when a rule is wrong."""
import importlib.util
import json
import logging
import random
import re
import sys
import unicodedata
from pathlib import Path

import numpy as np
import pytest
from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors,
                        trainers)

import infc.runtime.tokenization.fast_tokenize as ft
from infc.runtime.tokenization.fast_tokenize import FastEncoder, KNOWN_REGEXES
from infc.runtime.tokenization.tokenizer import Tokenizer as InfcTokenizer

REPO = Path(__file__).resolve().parent.parent


def _qwen_tool():
    spec = importlib.util.spec_from_file_location("infc_tools_qwen_tokenizer_ft", REPO / "tools" / "qwen_tokenizer.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return _qwen_tool().write_qwen_tokenizer(tmp_path_factory.mktemp("qwen_tok_fast"))


@pytest.fixture(scope="module")
def smol_dir():
    sys.path.insert(0, str(REPO / "tools"))
    from smollm2_from_gguf import ensure_smollm2
    return ensure_smollm2()


@pytest.fixture(scope="module")
def qwen(qwen_dir):
    return Tokenizer.from_file(str(qwen_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def smol(smol_dir):
    return Tokenizer.from_file(str(smol_dir / "tokenizer.json"))


def regex_variant(tk, name):
    """The same vocabulary and merges under another whitelisted pre-tokenizer regex."""
    d = json.loads(tk.to_str())
    d["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = next(k for k, v in KNOWN_REGEXES.items() if v == name)
    return Tokenizer.from_str(json.dumps(d))


POOLS = ["abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ", "0123456789", " ", "  ", "    ",
         " \t\n\r", "\n\n", "\r\n", ".,;:!?'\"()[]{}<>-_+=*/\\|@#$%^&~`", "的一是不了人我在有他这中大来上国",
         "あいうえおアイウエオ漢字", "😀👍🎉🚀❤️🇫🇷👨‍👩‍👧", "éèêàçüößñåøİıſﬁ", "e\u0301a\u0308\u0327o\u0302\u0301",
         "абвгдежзийклмн", "١٢٣४५६①②½Ⅻ", "\u00a0\u3000\u2003\u200b\u200d\ufeff\x0b\x0c\x1c\x85", "▁Ġ"]
WORDS = ["the", "quick", "brown", "fox", "I'm", "they'll", "DON'T", "12345", "3.14159", "x", "def", "return"]


def random_texts(tk, n, seed, max_parts=80):
    """Texts mixing every pool, words, and the tokenizer's added tokens whole, cut in two, with
    spaces inside and around them."""
    rng = random.Random(seed)
    added = sorted({t.content for t in tk.get_added_tokens_decoder().values()})
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(1, max_parts)):
            r = rng.random()
            if r < 0.12 and added:
                tok = rng.choice(added)
                k = rng.randint(0, len(tok))
                parts.append(rng.choice([tok, tok[:k], tok[:k] + " " + tok[k:], " " + tok, tok + " ",
                                         " " + tok + " ", "a" + tok + "b", tok + tok, "  " + tok + "  "]))
            elif r < 0.45:
                parts.append(rng.choice(["", " ", " ", "  ", "\n", " \n"]) + rng.choice(WORDS))
            else:
                pool = rng.choice(POOLS)
                parts.append("".join(rng.choice(pool) for _ in range(rng.randint(1, 10))))
        out.append("".join(parts))
    return out


def adversarial(tk):
    every = sorted({t.content for t in tk.get_added_tokens_decoder().values()})
    added = [t for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>") if t in every] + every[:4]
    texts = [
        "word " * 3000,                                          # the bench's kind of text
        "a" + " " * 5000 + "b",                                  # one long whitespace run
        " " * 3000, "\n" * 3000, "x\n" * 2000, "x \n" * 2000, "x  \n\n " * 600,
        "1234567890 " * 400, "1" * 5000 + " 2", "3.14 " * 800 + "42",
        "中文没有空格可以切分" * 400,                               # no candidate at all: one plain call
        "中文 " * 1500, "日本語 テキスト " * 500, "😀 " * 1500, "e\u0301 " * 1500, "x\u0301 y" * 800,
        "I'm ok 's 't " * 500, "a\t\tb \t c " * 500, "x\u00a0 y\u3000 z " * 500, "x\r\n y\r\n" * 600,
    ]
    for tok in added:
        texts += [f"x {tok} y" * 500, f"x{tok} y" * 500, f"x {tok}y" * 500, f"x{tok}{tok} " * 500,
                  (f"a {tok[:3]}" + " " + tok[3:]) * 500, f"{tok}\n{tok} " * 500, (" " * 7 + tok) * 400]
    return texts


def check_exact(tk, texts, **kw):
    fe = FastEncoder(tk, **kw)
    assert fe.enabled, fe.reason
    cut = 0
    for text in texts:
        want = tk.encode(text, add_special_tokens=False).ids
        assert fe.encode(text) == want, repr(text[:200])
        cut += len(fe.cuts(text))
    return fe, cut


# -- the rule, per tokenizer -------------------------------------------------------------------
def test_rules_of_the_fixtures(qwen_dir, smol_dir):
    q, s = InfcTokenizer(qwen_dir), InfcTokenizer(smol_dir)
    assert q.fast.rule == "Split/qwen2" and q.fast.reason is None           # NFC + Qwen2 regex + ByteLevel
    assert s.fast.rule == "ByteLevel/gpt2" and s.fast.reason is None        # Digits, then ByteLevel's regex
    text = "<|im_start|>user\n" + "hello there, 12 friends " * 800 + "<|im_end|>\n"
    for tok in (q, s):
        before = dict(tok.fast.stats)
        assert tok.encode_text(text) == tok.tk.encode(text, add_special_tokens=False).ids
        assert tok.fast.stats["fast"] == before["fast"] + 1             # taken, not silently plain
        assert tok.fast.stats["pieces"] - before["pieces"] >= len(text) // (2 * ft.CHUNK_CHARS)


@pytest.mark.parametrize("name", ["qwen", "smol", "qwen-llama3", "qwen-o200k", "qwen-gpt2"])
def test_random_texts_cut_everywhere(name, qwen, smol):
    """chunk_chars=1: a cut at every candidate, so every boundary kind occurs many times."""
    tk = {"qwen": qwen, "smol": smol}.get(name) or regex_variant(qwen, name.split("-")[1])
    fe, cut = check_exact(tk, random_texts(tk, 600, seed=sum(map(ord, name))), chunk_chars=1, min_chars=0)
    assert fe.rule.endswith({"qwen": "qwen2", "smol": "gpt2"}.get(name, name.split("-")[-1]))
    assert cut > 2500 and fe.stats["fast"] > 400


@pytest.mark.parametrize("name", ["qwen", "smol"])
def test_adversarial_texts(name, qwen, smol):
    tk = {"qwen": qwen, "smol": smol}[name]
    texts = adversarial(tk)
    fe, cut = check_exact(tk, texts, chunk_chars=64, min_chars=0)
    assert cut > 1000
    assert fe.cuts("中文没有空格可以切分" * 400) == []                    # no safe point: the plain call
    fe, _ = check_exact(tk, texts)                                       # the default sizes too


def test_no_cut_touches_an_added_token(qwen):
    fe = FastEncoder(qwen, chunk_chars=1, min_chars=0)
    text = "a <|im_start|> b<|im_end|> c <think>d e</think> f"
    cuts = fe.cuts(text)
    assert cuts == [text.index(" e</")]          # not beside a token, nor before one after spaces


# -- the prefix cache ------------------------------------------------------------------------------
def bench_text_prompts(tok):
    from infc.bench.prefix import TextPrompts
    return TextPrompts(tok, np.random.default_rng(0))


def test_bench_prompts_and_prefix_reuse(qwen_dir):
    """bench/prefix.py's text (one-token words): exact at each length, the prefix's pieces are
    reused by the next request, and only the new tail is encoded."""
    tok = InfcTokenizer(qwen_dir)
    p = bench_text_prompts(tok)
    for L in (1024, 4096, 16384):
        prefix = p.make(L)
        assert tok.encode(prefix) == tok.fast.plain(prefix)
        for _ in range(3):
            full = prefix + p.make(16, start=False)
            before = dict(tok.fast.stats)
            assert tok.encode(full) == tok.fast.plain(full)
            pieces = tok.fast.stats["pieces"] - before["pieces"]
            hits = tok.fast.stats["piece_hits"] - before["piece_hits"]
            assert pieces >= L * 4 // ft.CHUNK_CHARS and hits >= pieces - 2, (L, pieces, hits)


def test_growing_chat_history(qwen_dir, smol_dir):
    """A conversation re-sent with one more turn each time (the prefix-cache case): exact every
    time, special tokens included, with most pieces reused."""
    rng = random.Random(7)
    for d in (qwen_dir, smol_dir):
        tok = InfcTokenizer(d)
        chat = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        for turn in range(12):
            role = "user" if turn % 2 == 0 else "assistant"
            body = " ".join(rng.choice(WORDS + ["中文", "😀", "\n", "  ", "1.5"]) for _ in range(rng.randint(150, 400)))
            chat += f"<|im_start|>{role}\n{body}<|im_end|>\n"
            prompt = chat + "<|im_start|>assistant\n"
            before = dict(tok.fast.stats)
            assert tok.encode_text(prompt) == tok.tk.encode(prompt, add_special_tokens=False).ids
            if turn >= 5:
                assert tok.fast.stats["fast"] == before["fast"] + 1
                assert tok.fast.stats["piece_hits"] > before["piece_hits"]


def test_a_cached_piece_is_the_head_of_the_next_prompts_piece(qwen_dir):
    """A prompt that extends an earlier one (bench prefix's warm hit): the earlier prompt's last
    piece, cached, heads this prompt's piece at the same place, and only the new words after it
    are encoded."""
    tok = InfcTokenizer(qwen_dir)
    p = bench_text_prompts(tok)
    for L in (1024, 4096):
        prefix = p.make(L)
        tok.encode(prefix)
        last = prefix[tok.fast.cuts(prefix)[-1]:]                   # the prefix's last piece
        before = dict(tok.fast.stats)
        full = prefix + p.make(16, start=False)
        assert tok.encode(full) == tok.fast.plain(full)
        assert tok.fast.stats["head_hits"] == before["head_hits"] + 1
        assert tok.fast.stats["head_chars"] - before["head_chars"] == len(last)


def extensions(tk, seed: int, n: int) -> list[tuple[str, str]]:
    """(earlier, later) texts where later = earlier + more: the join falls after words, inside a
    word, at spaces and newlines, and beside, inside and across added tokens."""
    rng = random.Random(seed)
    added = sorted({t.content for t in tk.get_added_tokens_decoder().values()})[:8]
    base = random_texts(tk, n, seed, max_parts=60)
    joins = [" next words here", "tail of a word", "  two spaces", "\n new line", " ", "",
             "x", ".", " 12 34", " 中文 字", "'s more"]
    out = []
    for text in base:
        tok = rng.choice(added)
        k = rng.randint(1, len(tok) - 1)
        earlier = rng.choice([text, text + " " + tok[:k], text + tok, text + " word", text + " word "])
        more = rng.choice(joins + [" " + tok, tok, tok[k:] + " after", " " + tok + " after", tok + tok])
        out.append((earlier, earlier + more + rng.choice(["", " end of it", " " + rng.choice(WORDS)])))
    return out


@pytest.mark.parametrize("name", ["qwen", "smol"])
def test_heads_exact_at_every_kind_of_join(name, qwen, smol, monkeypatch):
    """Exact wherever the later text continues the earlier one: across a word, a whitespace run or
    an added token the head is refused, and where it is taken the ids are the plain call's (short
    pieces and heads, so that most texts have several)."""
    tk = {"qwen": qwen, "smol": smol}[name]
    monkeypatch.setattr(ft, "HEAD_CHARS", 4)
    fe = FastEncoder(tk, chunk_chars=48, min_chars=0)
    for earlier, later in extensions(tk, seed=5 if name == "qwen" else 6, n=700):
        assert fe.encode(earlier) == tk.encode(earlier, add_special_tokens=False).ids
        assert fe.encode(later) == tk.encode(later, add_special_tokens=False).ids, (repr(earlier[-40:]), repr(later[len(earlier):]))
    assert fe.stats["head_hits"] > 100            # the head path ran, not only refusals


def test_cache_budget(qwen):
    fe = FastEncoder(qwen, chunk_chars=256, min_chars=0, cache_chars=4000)
    for text in random_texts(qwen, 60, seed=3, max_parts=200):
        assert fe.encode(text) == qwen.encode(text, add_special_tokens=False).ids
        assert fe._cached_chars <= 4000 and fe._cached_chars == sum(len(s) for s in fe._cache)
        heads = {}
        for piece in fe._cache:
            if len(piece) >= ft.HEAD_CHARS:
                heads.setdefault(piece[:ft.HEAD_CHARS], set()).add(len(piece))
        assert fe._heads == heads                  # evictions leave no head behind
    off = FastEncoder(qwen, chunk_chars=256, min_chars=0, cache_chars=0)
    text = "word " * 2000
    assert off.encode(text) == off.encode(text) == qwen.encode(text, add_special_tokens=False).ids
    assert off._cache == {} and off.stats["piece_hits"] == 0


# -- added tokens next to cuts -------------------------------------------------------------------
def test_added_tokens_with_spaces_and_strip_flags(qwen):
    """Added tokens that contain "c ", or strip/need whitespace around them: the window check
    keeps cuts away from them (and is what makes this exact: without it, the same texts differ)."""
    tk = Tokenizer.from_str(qwen.to_str())
    tk.add_special_tokens([AddedToken("hello world", normalized=False),
                           AddedToken("<R>", rstrip=True, normalized=False),
                           AddedToken("<L>", lstrip=True, normalized=False),
                           AddedToken("<W>", single_word=True, normalized=False),
                           AddedToken(" lead", normalized=False)])
    rng = random.Random(11)
    pieces = ["hello world", "hello", "world", "<R>", "<L>", "<W>", " lead", "lead", "x", "x ", " ", "  ",
              "\n", "ab", "1", "中"]
    texts = ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 60))) for _ in range(1500)]
    check_exact(tk, texts, chunk_chars=1, min_chars=0)
    fe = FastEncoder(tk, chunk_chars=1, min_chars=0)
    fe._near_added_token = lambda text, p: False                        # the check removed
    assert any(fe.encode(t) != tk.encode(t, add_special_tokens=False).ids for t in texts)


def test_heads_never_split_an_added_token(qwen, monkeypatch):
    """A cached piece ending where a later text completes an added token that holds a space
    ("... hello" then " world", the token "hello world"): the head would cut the token in two;
    the window check refuses it (without it, these texts differ)."""
    monkeypatch.setattr(ft, "HEAD_CHARS", 4)
    tk = Tokenizer.from_str(qwen.to_str())
    tk.add_special_tokens([AddedToken("hello world", normalized=False)])
    rng = random.Random(3)
    pairs = []
    for _ in range(300):
        earlier = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 12))) + " hello"
        pairs.append((earlier, earlier + " world" + rng.choice(["", " and more", "!"])))

    def run(fe):
        bad = 0
        for earlier, later in pairs:
            assert fe.encode(earlier) == tk.encode(earlier, add_special_tokens=False).ids
            bad += fe.encode(later) != tk.encode(later, add_special_tokens=False).ids
        return bad
    for chunk in (8, 16, 24):
        assert run(FastEncoder(tk, chunk_chars=chunk, min_chars=0)) == 0
    fe = FastEncoder(tk, chunk_chars=16, min_chars=0)
    near = fe._near_added_token
    fe._near_added_token = lambda text, p: near(text, p) if fe._cuts_running else False
    cuts = fe.cuts

    def cuts_checked(*a, **k):                    # the check kept for cuts, removed for heads
        fe._cuts_running = True
        try:
            return cuts(*a, **k)
        finally:
            fe._cuts_running = False
    fe._cuts_running, fe.cuts = False, cuts_checked
    assert run(fe) > 0


# -- SentencePiece / Metaspace style -----------------------------------------------------------
CORPUS = [("The quick brown fox jumps over the lazy dog. " * 3 + "Numbers 12 345 6789, ünïcödé, 中文字符 and "
           "emoji 😀. it's they'll   spaced   out\n") * 20]


def spm_bpe(pre, normalizer=None):
    tk = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tk.normalizer = normalizer
    tk.pre_tokenizer = pre
    tk.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=list("▁"), show_progress=False)
    tk.train_from_iterator(CORPUS, trainer)
    tk.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    return tk


def spm_unigram():
    tk = Tokenizer(models.Unigram())
    tk.normalizer = normalizers.NFKC()
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    trainer = trainers.UnigramTrainer(vocab_size=200, special_tokens=["<unk>", "<s>"], unk_token="<unk>",
                                      show_progress=False)
    tk.train_from_iterator(CORPUS, trainer)
    tk.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    return tk


def spm_texts(tk):
    return random_texts(tk, 300, seed=5) + [CORPUS[0], " leading space", "  two", "x" * 50 + " " * 50]


@pytest.mark.parametrize("kind", ["metaspace-always", "metaspace-first-nfkc", "metaspace-never", "unigram"])
def test_metaspace_split_is_exact(kind):
    if kind == "unigram":
        tk = spm_unigram()
    else:
        scheme = kind.split("-")[1]
        tk = spm_bpe(pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=True),
                     normalizers.NFKC() if kind.endswith("nfkc") else None)
        if scheme == "always":          # a BOS template (Llama's): not applied without special tokens
            tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
            assert tk.encode("a b").ids[0] == 1 and tk.encode("a b", add_special_tokens=False).ids[0] != 1
    fe, cut = check_exact(tk, spm_texts(tk), chunk_chars=1, min_chars=0)
    assert fe.rule == "Metaspace" and cut > 1000


def test_sentencepiece_without_word_boundaries_stays_off(caplog):
    """Llama-2 style (Prepend + Replace normalizer, no pre-tokenizer: one 'word' per text) and
    Metaspace(split=False) have no provable cut: off by rule; forced on, the probe turns them off."""
    llama2 = spm_bpe(None, normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]))
    nosplit = spm_bpe(pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=False))
    for tk, why in ((llama2, "normalizer Prepend"), (nosplit, "Metaspace(split=False)")):
        fe = FastEncoder(tk)
        assert not fe.enabled and why in fe.reason
        text = "some words here " * 300
        assert fe.encode(text) == tk.encode(text, add_special_tokens=False).ids and fe.stats["fast"] == 0
    forced = pytest.MonkeyPatch()
    forced.setattr(ft, "derive_rule", lambda tk: ("forced", None))
    try:
        with caplog.at_level(logging.WARNING, logger="infc.tokenizer"):
            for tk in (llama2, nosplit):
                caplog.clear()
                fe = FastEncoder(tk)
                assert not fe.enabled and fe.reason.startswith("probe mismatch")
                assert "fast tokenization off" in caplog.text
    finally:
        forced.undo()


def test_probe_catches_a_wrong_cut_rule(qwen, monkeypatch, caplog):
    """Cutting before a newline is wrong for the Qwen regex ("x.\\n" is one pre-token); the
    load-time probe sees it and keeps the plain call, with a warning."""
    monkeypatch.setattr(ft, "CANDIDATE", re.compile(r"[!-~]\n"))
    with caplog.at_level(logging.WARNING, logger="infc.tokenizer"):
        fe = FastEncoder(qwen)
    assert not fe.enabled and "probe mismatch" in fe.reason and "fast tokenization off" in caplog.text
    monkeypatch.setattr(ft, "CANDIDATE", re.compile(r"[^\n] "))     # any left character (a space too)
    assert not FastEncoder(qwen).enabled


# -- what stays off, and the switches --------------------------------------------------------------
def qwen_like():
    """A small byte-level BPE configured as Qwen's (NFC, the Qwen2 regex, ByteLevel, added tokens)."""
    tk = Tokenizer(models.BPE())
    tk.normalizer = normalizers.NFC()
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(next(k for k, v in KNOWN_REGEXES.items() if v == "qwen2")), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=500, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tk.add_special_tokens([AddedToken("<|im_start|>", normalized=False), AddedToken("<|im_end|>", normalized=False)])
    return tk


def test_unsupported_configurations_stay_off():
    base = qwen_like()
    assert FastEncoder(base).rule == "Split/qwen2"

    def variant(edit):
        d = json.loads(base.to_str())
        edit(d)
        return FastEncoder(Tokenizer.from_str(json.dumps(d)))

    fe = variant(lambda d: d["pre_tokenizer"]["pretokenizers"][0]["pattern"].update(Regex=r"\S+\s*|\s+"))
    assert not fe.enabled and "not a known regex split" in fe.reason
    fe = variant(lambda d: d.update(normalizer={"type": "Strip", "strip_left": True, "strip_right": True}))
    assert not fe.enabled and "normalizer Strip" in fe.reason
    fe = variant(lambda d: d.update(pre_tokenizer=None))
    assert not fe.enabled and "no pre-tokenizer" in fe.reason
    fe = variant(lambda d: d.update(pre_tokenizer={"type": "ByteLevel", "add_prefix_space": False,
                                                   "trim_offsets": False, "use_regex": False}))
    assert not fe.enabled
    fe = variant(lambda d: d["model"].update(dropout=0.1))
    assert not fe.enabled and "dropout" in fe.reason

    def normalized_added(d):
        d["added_tokens"][-1]["normalized"] = True          # matched after NFC: not supported
    fe = variant(normalized_added)
    assert not fe.enabled and "normalized=True" in fe.reason


def test_truncation_padding_and_env(qwen, monkeypatch):
    tk = Tokenizer.from_str(qwen.to_str())
    fe = FastEncoder(tk)
    text = "word " * 3000
    tk.enable_truncation(100)
    assert fe.encode(text) == tk.encode(text, add_special_tokens=False).ids and fe.stats["fast"] == 0
    tk.no_truncation()
    tk.enable_padding(length=20000)
    assert fe.encode(text) == tk.encode(text, add_special_tokens=False).ids and fe.stats["fast"] == 0
    tk.no_padding()
    assert fe.encode(text) == tk.encode(text, add_special_tokens=False).ids and fe.stats["fast"] == 1
    monkeypatch.setenv("INFC_FAST_TOKENIZE", "0")
    assert not FastEncoder(tk).enabled


@pytest.mark.parametrize("pre", ["WhitespaceSplit", "Whitespace", "BertPreTokenizer"])
def test_word_level_whitespace_splits(pre):
    """bench/prefix's test tokenizer (WordLevel + WhitespaceSplit) and its kin: on and exact."""
    words = [a + b for a in "abcdefghij" for b in "abcdefghij"] + ["-", ".", "!"]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["[UNK]"] + words)}, unk_token="[UNK]"))
    tk.pre_tokenizer = getattr(pre_tokenizers, pre)()
    rng = random.Random(2)
    texts = ["".join(rng.choice(words + ["zz", "a-b", "x.y"]) + rng.choice([" ", " ", "  ", "\n", "", ". "])
                     for _ in range(600)) for _ in range(20)]
    fe, cut = check_exact(tk, texts, chunk_chars=16, min_chars=0)
    assert fe.rule == pre and cut > 1000


def test_nfc_lowercase_byte_level():
    tk = qwen_like()
    tk.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Lowercase()])
    fe, cut = check_exact(tk, random_texts(tk, 300, seed=9), chunk_chars=1, min_chars=0)
    assert fe.rule == "Split/qwen2" and cut > 1000


def test_ascii_is_a_normalization_boundary():
    """The normalizer half of the rule: no canonical decomposition has a printable ASCII
    character (or the space) after its first character, and ASCII has combining class 0, so
    NFC/NFKC never merge a character into the ASCII one after it."""
    ascii_chars = {chr(c) for c in range(0x20, 0x7F)}
    assert all(unicodedata.combining(c) == 0 for c in ascii_chars)
    for cp in range(0x110000):
        d = unicodedata.decomposition(chr(cp))
        if d and not d.startswith("<"):
            parts = [chr(int(x, 16)) for x in d.split()]
            assert not (set(parts[1:]) & ascii_chars), hex(cp)
    for c in ascii_chars:
        for x in ("e\u0301", "\u1100", "\u1161", "ﬁ", "\u0345", "Å", "한"):
            for form in ("NFC", "NFD", "NFKC", "NFKD"):
                assert unicodedata.normalize(form, x + c) == unicodedata.normalize(form, x) + c


# -- bench/prefix.py's tokenizer path ----------------------------------------------------------------
def test_bench_prefix_tokenizer_path(qwen_dir, tmp_path):
    from infc.bench import prefix as bench
    res = bench.main(["--model-path", str(qwen_dir), "--path", "tokenizer", "--lengths", "1024,4096",
                      "--reps", "2", "--out", str(tmp_path)])
    rec = res["paths"]["tokenizer"]
    assert rec["fast_path"] == "Split/qwen2" and list(rec["results"]) == ["1024", "4096"]
    for r in rec["results"].values():
        assert r["tokenize_fast_path"] and r["tokenize_ms"] > 0 and r["tokenize_cold_ms"] > 0
        assert r["tokenize_plain_ms"] > 0
    saved = json.loads(next(tmp_path.glob("prefix-tokenizer-*.json")).read_text())
    assert saved["paths"]["tokenizer"]["results"]["4096"]["chars"] > 4096
