"""Property-based fuzz of the server's request handling (hypothesis): more than 2,000 malformed
requests, every one answered 4xx with an OpenAI-shaped error and none 5xx (nor 422).

Each generated request is malformed by construction: a body of otherwise plausible fields
(random valid values, unknown extra fields) with at least one field set to a value that is wrong
for it (type, range, shape, encoding), or garbage bytes, or a JSON value that is not a request,
or a bad key on a keyed server. So none of them reaches the engine, and the fuzz costs no model
time; the real SmolLM2 server is the one under test."""
import http.client
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_server_support import MAX_MODEL_LEN, VOCAB_SIZE, live, one_blas_thread, srv  # noqa: F401

COUNTS = {}
SETTINGS = dict(deadline=None, database=None, derandomize=True, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much])


class Conn:
    """One keep-alive connection, reopened when the server closes it."""

    def __init__(self, port):
        self.port, self.c = port, None

    def send(self, method, path, raw: bytes | None, headers=None):
        for attempt in range(2):
            if self.c is None:
                self.c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
            try:
                self.c.request(method, path, body=raw, headers={"Content-Type": "application/json", **(headers or {})})
                r = self.c.getresponse()
                body = r.read()
                if (r.getheader("connection") or "").lower() == "close":
                    self.c.close()
                    self.c = None
                return r.status, r.getheader("content-type") or "", body
            except (http.client.HTTPException, ConnectionError, OSError):
                self.c.close()
                self.c = None
                if attempt:
                    raise


_conns = {}


def conn(port) -> Conn:
    if port not in _conns:
        _conns[port] = Conn(port)
    return _conns[port]


def check(kind, status, ctype, body, allowed=range(400, 500)):
    COUNTS[kind] = COUNTS.get(kind, 0) + 1
    assert status < 500, (status, body[:300])
    assert status != 422
    assert status in allowed, (status, body[:300])
    if ctype.startswith("application/json"):
        err = json.loads(body)["error"]
        assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str)


# -- values -----------------------------------------------------------------------------------------
scalars = (st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats(allow_nan=False, allow_infinity=False)
           | st.text(max_size=12))
values = st.recursive(st.none() | scalars, lambda ch: st.lists(ch, max_size=3) | st.dictionaries(
    st.text(max_size=6), ch, max_size=3), max_leaves=8)
present = values.filter(lambda v: v is not None)          # null means "absent", which is valid
not_number = present.filter(lambda v: isinstance(v, bool) or not isinstance(v, (int, float)))
not_int = present.filter(lambda v: isinstance(v, bool) or not isinstance(v, int) and not (
    isinstance(v, float) and v.is_integer()))
not_bool = present.filter(lambda v: not isinstance(v, bool))
surrogate = st.just("\ud800 text")
big = 2 ** 64

BAD_COMMON = {
    "temperature": st.floats(max_value=-1e-9, allow_nan=False, allow_infinity=False) | not_number,
    "top_p": st.floats(max_value=0, allow_nan=False, allow_infinity=False)
    | st.floats(min_value=1.0001, allow_nan=False, allow_infinity=False) | not_number,
    "top_k": st.integers(max_value=-2) | not_int,
    "min_p": st.floats(max_value=-1e-9, allow_nan=False, allow_infinity=False)
    | st.floats(min_value=1.0001, allow_nan=False, allow_infinity=False) | not_number,
    "n": st.integers(max_value=0) | st.integers(min_value=129) | not_int,
    "seed": st.integers(min_value=big) | st.integers(max_value=-2 ** 63 - 1) | not_int,
    "stop": st.just("") | st.lists(st.text(max_size=3), min_size=17, max_size=20)
    | st.lists(present.filter(lambda v: not isinstance(v, str)), min_size=1, max_size=3) | st.just([""])
    | surrogate | st.integers() | st.dictionaries(st.text(max_size=3), scalars, max_size=2),
    "stop_token_ids": st.lists(st.integers(min_value=VOCAB_SIZE) | st.integers(max_value=-1), min_size=1, max_size=3)
    | st.lists(not_int, min_size=1, max_size=3) | not_number.filter(lambda v: not isinstance(v, list)),
    "ignore_eos": not_bool, "skip_special_tokens": not_bool, "stream": not_bool,
    "min_tokens": st.integers(max_value=-1) | not_int,
    "stream_options": present.filter(lambda v: not isinstance(v, dict)),
    "model": st.text(max_size=10).filter(lambda s: s not in ("smol", "smol-alias")) | present.filter(
        lambda v: not isinstance(v, str)),
    "presence_penalty": st.floats(min_value=2.01, max_value=1e9) | st.text(min_size=1, max_size=3),
    "frequency_penalty": st.floats(min_value=-1e9, max_value=-2.01) | st.lists(scalars, max_size=2),
    "repetition_penalty": st.floats(min_value=-1e9, max_value=0) | st.text(min_size=1, max_size=3),
    "logit_bias": st.dictionaries(st.text(alphabet="xyz-", min_size=1, max_size=3), st.integers(), min_size=1, max_size=2)
    | st.dictionaries(st.integers(min_value=VOCAB_SIZE).map(str), st.integers(), min_size=1, max_size=2),
    "best_of": st.integers(max_value=0) | st.integers(min_value=129) | not_int,
    "bad_words": st.just([""]) | st.integers() | st.lists(st.integers(), min_size=1, max_size=2),
    "allowed_token_ids": st.just([]) | st.lists(st.integers(min_value=VOCAB_SIZE), min_size=1, max_size=2),
    "include_stop_str_in_output": not_bool,
    "use_beam_search": st.just(True),
    "response_format": st.just({"type": "json_schema", "json_schema": {}}) | st.just({"type": "xml"})
    | st.text(max_size=4),
    "user": present.filter(lambda v: not isinstance(v, str)),
}
BAD_COMPLETION = dict(BAD_COMMON, **{
    "prompt": st.just([]) | st.just("") | st.just([[]]) | surrogate | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.lists(st.integers(min_value=VOCAB_SIZE), min_size=1, max_size=3)
    | st.lists(st.integers(max_value=-1), min_size=1, max_size=3)
    | st.lists(st.one_of(st.text(max_size=3), st.integers(0, 100)), min_size=2, max_size=4).filter(
        lambda xs: len({type(x) for x in xs}) > 1)
    | st.lists(st.dictionaries(st.text(max_size=3), scalars, max_size=2), min_size=1, max_size=2)
    | st.lists(st.text(max_size=3), min_size=257, max_size=260),
    "max_tokens": st.integers(max_value=-1) | st.integers(min_value=MAX_MODEL_LEN) | not_int,
    "logprobs": st.integers(min_value=21) | st.integers(max_value=-1) | st.booleans() | not_int,
    "echo": not_bool,
    "suffix": st.text(min_size=1, max_size=5),
})
BAD_CHAT = dict(BAD_COMMON, **{
    "messages": st.just([]) | present.filter(lambda v: not isinstance(v, list))
    | st.lists(present.filter(lambda v: not isinstance(v, dict)), min_size=1, max_size=2)
    | st.lists(st.fixed_dictionaries({"role": not_number.filter(lambda v: not isinstance(v, str)) | st.just("")},
                                     optional={"content": st.text(max_size=5)}), min_size=1, max_size=2)
    | st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": st.integers() | st.dictionaries(
        st.text(max_size=2), scalars, min_size=1, max_size=2) | st.just([{"type": "image_url", "image_url": {}}])
        | surrogate}), min_size=1, max_size=2),
    "max_completion_tokens": st.integers(max_value=0) | st.integers(min_value=MAX_MODEL_LEN) | not_int,
    "max_tokens": st.integers(max_value=0) | st.integers(min_value=MAX_MODEL_LEN) | not_int,
    "logprobs": not_bool,
    "top_logprobs": st.integers(min_value=21) | st.integers(max_value=-1) | not_int,
    "chat_template_kwargs": present.filter(lambda v: not isinstance(v, dict))
    | st.fixed_dictionaries({"x": surrogate}),
    "tools": present.filter(lambda v: not (isinstance(v, list) and all(isinstance(t, dict) for t in v))),
    "tool_choice": st.just("required") | st.just({"type": "function", "function": {"name": "f"}}),
    "chat_template": st.sampled_from(["{% for %}", "{{ raise_exception('bad') }}", "{{ messages[0]['content'] + 1 }}",
                                      "{{ ''.__class__.__mro__[1].__subclasses__() }}", "{% if %}", "{{ x.y.z() }}"]),
    "echo": st.just(True),
    "continue_final_message": not_bool,
})

GOOD_COMMON = {
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.integers(-1, 40),
    "min_p": st.floats(0, 1), "seed": st.integers(0, 1000), "n": st.integers(1, 2),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=2), "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(), "stream": st.booleans(), "min_tokens": st.just(0),
    "model": st.sampled_from(["smol", "smol-alias"]), "user": st.text(max_size=5),
    "presence_penalty": st.just(0), "stop_token_ids": st.lists(st.integers(0, 1000), max_size=2),
}
GOOD_COMPLETION = dict(GOOD_COMMON, prompt=st.just("Hi") | st.just([1, 2, 3]) | st.just(["a", "b"]),
                       max_tokens=st.integers(1, 2), logprobs=st.integers(0, 3), echo=st.booleans())
GOOD_CHAT = dict(GOOD_COMMON, messages=st.just([{"role": "user", "content": "Hi"}]),
                 max_tokens=st.integers(1, 2), logprobs=st.booleans(), chat_template_kwargs=st.just({"enable_thinking": False}))
unknown_fields = st.dictionaries(st.text(min_size=1, max_size=8).filter(
    lambda k: k not in GOOD_COMPLETION and k not in BAD_CHAT), values, max_size=3)


@st.composite
def malformed(draw, good, bad, required):
    body = draw(unknown_fields)
    for k in draw(st.lists(st.sampled_from(sorted(good)), unique=True, max_size=6)):
        body[k] = draw(good[k])
    for k in required:
        body.setdefault(k, draw(good[k]))
    wrong = draw(st.lists(st.sampled_from(sorted(bad)), min_size=1, max_size=2, unique=True))
    for k in wrong:
        body[k] = draw(bad[k])
    if "stream_options" in wrong:
        body.pop("stream", None)
    if "best_of" in wrong:
        body["n"] = 1
    return body


def dumps(body) -> bytes:
    return json.dumps(body, allow_nan=False).encode("utf-8", "surrogatepass")


@settings(max_examples=800, **SETTINGS)
@given(body=malformed(GOOD_COMPLETION, BAD_COMPLETION, ["prompt"]))
def test_fuzz_completions(srv, body):
    check("completions", *conn(srv.port).send("POST", "/v1/completions", dumps(body)))


@settings(max_examples=600, **SETTINGS)
@given(body=malformed(GOOD_CHAT, BAD_CHAT, ["messages"]))
def test_fuzz_chat(srv, body):
    check("chat", *conn(srv.port).send("POST", "/v1/chat/completions", dumps(body)))


def _not_a_request(raw: bytes) -> bool:
    try:
        v = json.loads(raw)
    except ValueError:
        return True
    return not (isinstance(v, dict) and ({"prompt", "messages", "tokens"} & set(v)))


@settings(max_examples=300, **SETTINGS)
@given(raw=st.binary(max_size=64).filter(_not_a_request) | values.filter(
    lambda v: not (isinstance(v, dict) and ({"prompt", "messages", "tokens"} & set(v)))).map(
    lambda v: json.dumps(v).encode()) | st.sampled_from([b"{", b'{"prompt": NaN}', b'{"prompt": Infinity}',
                                                       b'{"prompt": 1e400, "n": 1e400}', b"[" * 3000, b"\xc3\x28"]),
       path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]))
def test_fuzz_raw_bodies(srv, raw, path):
    check("raw", *conn(srv.port).send("POST", path, raw))


@settings(max_examples=200, **SETTINGS)
@given(body=st.one_of(
    st.fixed_dictionaries({"prompt": present.filter(lambda v: not isinstance(v, str)) | surrogate}),
    st.fixed_dictionaries({"prompt": st.just("x"), "add_special_tokens": not_bool}),
    st.fixed_dictionaries({"messages": BAD_CHAT["messages"]}),
    st.fixed_dictionaries({"prompt": st.just("x"), "model": BAD_COMMON["model"]})),
    tokens=st.lists(st.integers(min_value=VOCAB_SIZE) | st.integers(max_value=-1), min_size=1, max_size=3)
    | present.filter(lambda v: not isinstance(v, list)) | st.lists(not_int, min_size=1, max_size=2))
def test_fuzz_tokenizer_endpoints(srv, body, tokens):
    c = conn(srv.port)
    check("tokenize", *c.send("POST", "/tokenize", dumps(body)))
    check("detokenize", *c.send("POST", "/detokenize", dumps({"tokens": tokens})))


@settings(max_examples=150, **SETTINGS)
@given(method=st.sampled_from(["GET", "PUT", "DELETE", "PATCH", "POST"]),
       path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/nope",
                             "/v1/embeddings", "/v1/models/absent"]),
       key=st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), max_size=20))
def test_fuzz_methods_paths_and_keys(method, path, key):
    s = live(api_key="fuzz-key")
    raw = b'{"prompt": "x", "max_tokens": 1}'
    status, ctype, body = conn(s.port).send(method, path, raw, {"Authorization": f"Bearer {key}"})
    check("keys", status, ctype, body, allowed=(401, 404, 405))


def test_fuzz_total():
    if len(COUNTS) < 6:
        pytest.skip("runs after the whole fuzz module")
    assert sum(COUNTS.values()) >= 2000, COUNTS
    print(f"fuzzed {sum(COUNTS.values())} malformed requests: {COUNTS}")
