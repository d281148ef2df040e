"""vLLM's cache_salt: a request's cached KV is shared only with requests of the same salt. Its
blocks are named with the salt (block_manager._hasher), so the prefix cache, the recent prompts'
hashes, the KV tiers and the draft model's cache never hand one salt's blocks to another or to
an unsalted request; the server and LLM take the field as vLLM does and refuse a bad one."""
import hashlib
import json

import pytest

from infc.runtime.engine.block_manager import BlockManager, _hasher, prefix_hash
from infc.runtime.engine.sampling import SamplingParams
from infc.runtime.engine.sequence import Sequence
from test_scheduler import FakeRunner, drain, make_engine
from test_server_scoring import TEXT, post
from test_server_support import assert_clean, backend, live, one_blas_thread, request, srv  # noqa: F401

PS = 4


def seq(tokens, sid=0, salt=None, lora=None):
    s = Sequence(sid, f"r{sid}", 0, tokens, SamplingParams(), seed=0)
    s.cache_salt, s.lora = salt, lora
    return s


@pytest.mark.parametrize("lora", [None, ("a", 7)])
def test_a_salt_names_every_block_and_sits_four_bytes_past_whole_tokens(lora):
    bm = BlockManager(64, PS)
    tokens = list(range(100, 121))
    n = 5
    plain = bm._hashes(seq(tokens, 0, None, lora), n)
    seen = {tuple(plain)}
    for i, salt in enumerate(["s", "salt-b", "x" * 8, "é" * 5, "a much longer salt, 43 chars of base64 ..."]):
        got = bm._hashes(seq(tokens, 10 + i, salt, lora), n)
        assert tuple(got) not in seen                 # no block shared with another salt or none
        seen.add(tuple(got))
        again = BlockManager(64, PS)._hashes(seq(tokens, 99, salt, lora), n)
        assert got == again                           # the same salt names the same blocks
        h = _hasher(seq(tokens, 0, salt, lora))
        head = (b"" if lora is None else b"lora" + (7).to_bytes(8, "little")) + b"salt" + \
            len(salt.encode()).to_bytes(8, "little") + salt.encode()
        head += bytes((4 - len(head)) % 8)
        assert len(head) % 8 == 4
        assert h.digest() == hashlib.sha256(head).digest()
    assert bm._hashes(seq(tokens, 50), n) == [prefix_hash(tokens[:(i + 1) * PS]) for i in range(n)]


def test_recent_prompts_never_lend_hashes_across_salts():
    bm = BlockManager(64, PS)
    tokens = list(range(40))
    want = {salt: BlockManager(64, PS)._hashes(seq(tokens, 0, salt), 9) for salt in (None, "a", "b")}
    for i, salt in enumerate([None, "a", "b", "a", None, "b"]):
        assert bm._hashes(seq(tokens, i, salt), 9) == want[salt], (i, salt)
    assert bm.recent.reused_blocks == 3 * 9          # the repeats of a, None and b only


def test_the_engine_shares_cached_blocks_within_a_salt_only():
    e = make_engine(FakeRunner(64, PS))
    prompt = list(range(1, 30))
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    hits = []
    for i, salt in enumerate([None, "tenant-a", "tenant-a", "tenant-b", None]):
        before = e.bm.hit_tokens
        e.add_request(prompt, params, f"r{i}", cache_salt=salt)
        drain(e)
        hits.append(e.bm.hit_tokens - before)
    full = (len(prompt) - 1) // PS * PS
    assert hits == [0, 0, full, 0, full]
    for bad in ("", 5, b"x"):
        with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
            e.add_request(prompt, params, f"bad-{bad!r}", cache_salt=bad)


def test_the_draft_models_cache_is_salted_alike():
    from test_spec_draft import with_draft
    e = with_draft(FakeRunner(64), FakeRunner(64))
    prompt = list(range(1, 30))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    hits = []
    for i, salt in enumerate(["a", None, "b", "a"]):
        before = e.spec.draft.bm.hit_tokens
        e.add_request(prompt, params, f"r{i}", cache_salt=salt)
        drain(e)
        hits.append(e.spec.draft.bm.hit_tokens - before)
    assert hits[:3] == [0, 0, 0] and hits[3] > 0, hits


def _cached(s, body, path="/v1/completions") -> int:
    return post(s, body, path)["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_the_server_takes_cache_salt_as_vllm_does(srv):
    """Completions and chat: a salted request hits only its salt's cache; a bad salt is vLLM's 400."""
    s = live(enable_prompt_tokens_details=True)      # shared with other tests: prompts of its own
    page = backend().page_size
    ids = backend().tokenizer.encode("On salted caches. " + TEXT)[:3 * page + 5]
    full = (len(ids) - 1) // page * page
    body = {"model": "smol", "prompt": ids, "max_tokens": 1, "temperature": 0}
    assert [_cached(s, dict(body, cache_salt="a")), _cached(s, dict(body, cache_salt="a")),
            _cached(s, dict(body, cache_salt="b")), _cached(s, body), _cached(s, body)] == [0, full, 0, 0, full]
    chat = {"model": "smol", "messages": [{"role": "user", "content": "On salted chats. " + TEXT}],
            "max_tokens": 1, "temperature": 0}
    to_chat = "/v1/chat/completions"
    first = _cached(s, dict(chat, cache_salt="c"), to_chat)
    assert first == 0 and _cached(s, dict(chat, cache_salt="c"), to_chat) > 0
    assert _cached(s, dict(chat, cache_salt="d"), to_chat) == 0
    for path, b in (("/v1/completions", body), ("/v1/chat/completions", chat)):
        for bad in ("", 7, ["a"], {"a": 1}):
            status, _, raw = request(s.port, "POST", path, dict(b, cache_salt=bad))
            err = json.loads(raw)["error"]
            assert status == 400 and err["param"] == "cache_salt", raw[:300]
            assert err["message"] == "Parameter 'cache_salt' must be a non-empty string if provided."
    assert_clean(s)


def test_llm_takes_vllms_prompt_dicts_with_a_salt():
    from infc.llm import _prompt_and_salt
    assert _prompt_and_salt("hi") == ("hi", None)
    assert _prompt_and_salt({"prompt": "hi", "cache_salt": "s"}) == ("hi", "s")
    assert _prompt_and_salt({"prompt_token_ids": [1, 2]}) == ([1, 2], None)
    for bad in ({}, {"prompt": "a", "prompt_token_ids": [1]}, {"prompt": "a", "salt": "s"}):
        with pytest.raises(ValueError, match="one of 'prompt'"):
            _prompt_and_salt(bad)
