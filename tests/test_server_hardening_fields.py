"""Issue 39: every numeric field is bounded where the engine packs it (runtime/cuda/sampler.py:
top_k int32, temperature / top_p / min_p float32, the seed 64 bits), and the cheap bounds refuse
what can never fit before anything is tokenized or walked. The parser's rules directly (fast, no
server), and the top_k / seed / temperature bounds on the wire against the real SmolLM2."""
import json

import numpy as np
import pytest

from infc.runtime.tokenization.tokenizer import Tokenizer
from infc.server import protocol
from infc.server.protocol import APIError, Limits
from test_server_support import MAX_MODEL_LEN, VOCAB_SIZE, live, one_blas_thread, request  # noqa: F401

SEED_MAX = 2 ** 63 - 1


@pytest.fixture(scope="module")
def tok():
    from smollm2_from_gguf import ensure_smollm2
    return Tokenizer(ensure_smollm2())


@pytest.fixture(scope="module")
def lim(tok):
    return Limits(MAX_MODEL_LEN, VOCAB_SIZE, 20, 128, protocol.prompt_char_bound(tok, MAX_MODEL_LEN))


def completion(lim, tok, **body):
    return protocol.parse_completion(dict({"prompt": "hi", "max_tokens": 2}, **body), lim, tok)


def refused(fn, *args, **kw) -> APIError:
    with pytest.raises(APIError) as e:
        fn(*args, **kw)
    assert e.value.status == 400
    return e.value


# -- the sampler's packed fields ------------------------------------------------------------------
@pytest.mark.parametrize("top_k", [VOCAB_SIZE + 1, 2 ** 31, 2 ** 63, 10 ** 30])
def test_top_k_above_the_vocabulary_is_400(lim, tok, top_k):
    e = refused(completion, lim, tok, top_k=top_k)
    assert e.param == "top_k" and str(VOCAB_SIZE) in e.message


def test_top_k_up_to_the_vocabulary_fits_int32(lim, tok):
    for k in (-1, 0, 1, VOCAB_SIZE):
        top_k = completion(lim, tok, top_k=k).params.top_k
        assert np.int32(top_k) == top_k


@pytest.mark.parametrize("seed", [2 ** 63, 2 ** 64 - 1, -2 ** 63 - 1])
def test_seed_outside_signed_64_bits_is_400(lim, tok, seed):
    assert refused(completion, lim, tok, seed=seed).param == "seed"


def test_seed_inside_signed_64_bits(lim, tok):
    for seed in (-2 ** 63, -1, 0, SEED_MAX):
        assert 0 <= completion(lim, tok, seed=seed).params.seed < 2 ** 64


def test_temperature_must_be_finite_in_float32(lim, tok):
    assert refused(completion, lim, tok, temperature=1e39).param == "temperature"
    t = completion(lim, tok, temperature=3e38).params.temperature
    assert t == 3e38 and np.isfinite(np.float32(t))


def test_a_top_p_float32_would_round_to_zero_keeps_the_likeliest_token(lim, tok):
    for top_p in (1e-45, 1e-300, 5e-324):
        p = completion(lim, tok, top_p=top_p).params.top_p
        assert np.float32(p) > 0 and np.isfinite(np.float32(p))
        assert p <= 1.2e-38                      # no more than float32's smallest normal: still "the top token"
    assert completion(lim, tok, top_p=0.5).params.top_p == 0.5


def test_min_tokens_bounded_by_the_context_even_without_max_tokens(lim, tok):
    chat = {"messages": [{"role": "user", "content": "hi"}], "min_tokens": 10 ** 30}
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert refused(protocol.parse_chat, chat, lim, tok, template, {}).param == "min_tokens"
    chat["min_tokens"] = MAX_MODEL_LEN
    assert protocol.parse_chat(chat, lim, tok, template, {}).params.min_tokens == MAX_MODEL_LEN


# -- cheap bounds before any work -------------------------------------------------------------------
class _NoTokenizing:
    """The real tokenizer's vocabulary; any encode is a test failure (the cheap bound must come first)."""

    def __init__(self, tok):
        self.tk = tok.tk

    def encode(self, text):
        raise AssertionError(f"tokenized {len(text)} characters")

    encode_text = encode


def test_prompt_chars_over_the_bound_refused_before_tokenizing(lim, tok):
    longest = max(map(len, tok.tk.get_vocab(with_added_tokens=True)))
    assert lim.max_prompt_chars == MAX_MODEL_LEN * longest
    guard = _NoTokenizing(tok)
    e = refused(completion, lim, guard, prompt="a" * (lim.max_prompt_chars + 1))
    assert e.code == "context_length_exceeded" and e.param == "prompt"
    e = refused(completion, lim, guard, prompt=["hi", "a" * (lim.max_prompt_chars + 1)])
    assert e.code == "context_length_exceeded"
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    chat = {"messages": [{"role": "user", "content": "a" * (lim.max_prompt_chars + 1)}]}
    e = refused(protocol.parse_chat, chat, lim, guard, template, {})
    assert e.code == "context_length_exceeded" and e.param == "messages"


def test_max_tokens_past_the_context_refused_before_tokenizing(lim, tok):
    guard = _NoTokenizing(tok)
    e = refused(completion, lim, guard, max_tokens=10 ** 30)
    assert e.code == "context_length_exceeded" and e.param == "max_tokens"
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": MAX_MODEL_LEN}
    e = refused(protocol.parse_chat, chat, lim, guard, "{{ messages[0]['content'] }}", {})
    assert e.code == "context_length_exceeded" and e.param == "max_tokens"


def test_an_id_list_past_the_context_refused_by_its_length(lim, tok):
    # the length alone decides: the bad element at the end is never reached
    e = refused(completion, lim, tok, prompt=[0] * MAX_MODEL_LEN + ["x"])
    assert e.code == "context_length_exceeded" and e.param == "prompt"
    e = refused(completion, lim, tok, prompt=[[1, 2], [0] * (4 * MAX_MODEL_LEN)])
    assert e.code == "context_length_exceeded"


def test_ids_still_checked_in_full_when_short_enough(lim, tok):
    assert refused(completion, lim, tok, prompt=[1, 2, "x"]).param == "prompt"
    assert refused(completion, lim, tok, prompt=[1, VOCAB_SIZE]).param == "prompt"
    assert refused(completion, lim, tok, prompt=["a", [1]]).param == "prompt"
    assert completion(lim, tok, prompt=[1, 2, 3]).prompts == [[1, 2, 3]]


# -- on the wire --------------------------------------------------------------------------------------
@pytest.mark.parametrize("field,value", [("top_k", 2 ** 31), ("top_k", VOCAB_SIZE + 1), ("seed", 2 ** 63),
                                         ("temperature", 1e39)])
def test_out_of_range_numbers_are_400_on_the_wire(field, value):
    s = live()
    status, _, body = request(s.port, "POST", "/v1/completions",
                              {"model": "smol", "prompt": "hi", "max_tokens": 1, field: value})
    err = json.loads(body)["error"]
    assert status == 400 and err["param"] == field, err


def test_edge_values_are_served():
    s = live()
    for extra in ({"top_k": VOCAB_SIZE}, {"seed": SEED_MAX}, {"seed": -2 ** 63}, {"top_p": 1e-45}):
        status, _, body = request(s.port, "POST", "/v1/completions",
                                  {"model": "smol", "prompt": "hi", "max_tokens": 1, **extra})
        assert status == 200, (extra, body[:200])
