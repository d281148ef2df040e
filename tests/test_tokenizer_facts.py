"""runtime/tokenization/facts.py: what a tokenizer's load derives from its vocabulary (the longest
token, the fast encoder's probe) is kept across loads, keyed by the files, the library and the
code; a changed file, an unreadable or unwritable cache derive them again and fail nothing."""
import json
import os

import pytest
import tokenizers

from infc.runtime.tokenization import facts
from infc.runtime.tokenization.fast_tokenize import FastEncoder
from infc.runtime.tokenization.tokenizer import Tokenizer
from grammar_fixtures import small_tokenizer


@pytest.fixture
def cache(tmp_path, monkeypatch):
    d = tmp_path / "facts"
    monkeypatch.setenv("INFC_TOKENIZER_CACHE", str(d))
    return d


@pytest.fixture
def tok_dir(tmp_path, cache):
    small_tokenizer(tmp_path / "tok")
    for f in cache.glob("*.json"):          # small_tokenizer's own load: start from no facts
        f.unlink()
    return tmp_path / "tok"


def longest(tok: Tokenizer) -> int:
    return max(map(len, tok.tk.get_vocab(with_added_tokens=True)))


def kept(cache) -> dict:
    files = list(cache.glob("*.json"))
    assert len(files) == 1, files
    return json.loads(files[0].read_text())


def test_a_first_load_keeps_its_facts_and_a_second_reads_them(tok_dir, cache, monkeypatch):
    first = Tokenizer(tok_dir)
    assert first.fast.enabled and first.fast.probed == "ok"
    assert first.max_token_chars == longest(first)
    assert kept(cache) == {"probe": "ok", "max_token_chars": longest(first)}
    # the second load reads them: no probe runs, and a planted longest token is what it says
    facts.write(facts.key(tok_dir), {"probe": "ok", "max_token_chars": 777})
    monkeypatch.setattr(FastEncoder, "_probe", lambda self: pytest.fail("the probe ran again"))
    second = Tokenizer(tok_dir)
    assert second.fast.enabled and second.fast.probed is None
    assert second.max_token_chars == 777
    assert second.encode("hello world 123") == first.encode("hello world 123")


def test_a_kept_probe_failure_keeps_the_plain_call(tok_dir, cache):
    facts.write(facts.key(tok_dir), {"probe": "probe mismatch on 'x y'"})
    t = Tokenizer(tok_dir)
    assert not t.fast.enabled and "probe mismatch on 'x y'" in t.fast.reason
    text = "hello world 123-4567 " * 300
    assert t.encode(text) == t.tk.encode(text, add_special_tokens=False).ids


def test_a_changed_file_a_new_library_or_new_code_derive_them_again(tok_dir, cache, monkeypatch):
    Tokenizer(tok_dir)
    k = facts.key(tok_dir)
    facts.write(k, {"probe": "ok", "max_token_chars": 777})
    path = tok_dir / "tokenizer.json"
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert facts.key(tok_dir) != k
    assert Tokenizer(tok_dir).max_token_chars == longest(Tokenizer(tok_dir)) != 777
    k = facts.key(tok_dir)
    (tok_dir / "tokenizer_config.json").write_text("{}")
    assert facts.key(tok_dir) != k
    k = facts.key(tok_dir)
    monkeypatch.setattr(tokenizers, "__version__", tokenizers.__version__ + ".post1")
    assert facts.key(tok_dir) != k
    monkeypatch.setattr(facts, "_code_hash", "other code")
    assert facts.key(tok_dir) not in (k, None)


@pytest.mark.parametrize("bad", ["not json", "[1, 2]", '{"max_token_chars": -3, "probe": 5}',
                                 '{"max_token_chars": "9", "probe": false}', '{"probe": ""}'])
def test_an_unreadable_or_malformed_file_is_no_facts(tok_dir, cache, bad):
    cache.mkdir(exist_ok=True)
    (cache / f"{facts.key(tok_dir)}.json").write_text(bad)
    t = Tokenizer(tok_dir)
    assert t.fast.enabled and t.fast.probed == "ok"
    assert t.max_token_chars == longest(t)
    assert kept(cache) == {"probe": "ok", "max_token_chars": longest(t)}


def test_an_unwritable_cache_keeps_nothing_and_fails_nothing(tok_dir, tmp_path, monkeypatch):
    blocker = tmp_path / "a file"
    blocker.write_text("")
    monkeypatch.setenv("INFC_TOKENIZER_CACHE", str(blocker / "facts"))
    t = Tokenizer(tok_dir)
    assert t.fast.enabled and t.max_token_chars == longest(t)
    assert not (blocker / "facts").exists()
    assert list(tmp_path.glob("**/*.tmp")) == []
