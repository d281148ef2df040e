"""Generated HTTP requests for the mixed server fuzz (tests/test_server_fuzz_mixed.py): no tests here.

`make_case(seed, i, ...)` is case i of a deterministic stream (its own random.Random, seeded by
(seed, i)), so a case is reproduced from its index alone, whatever order a pool of clients sends
them in. A case is one of
- valid: a request this server must answer 200 (it reaches the engine, so it is kept cheap:
  short prompts, 1-4 new tokens), built over every field of /v1/completions and
  /v1/chat/completions (those the server implements with their real values, those it does not
  with their neutral values), /tokenize and /detokenize;
- mutated: a valid body with one to three fields replaced by wrong values (types, ranges, sizes,
  encodings, huge numbers, nested garbage) or removed; any status but 5xx may answer it, since
  some wrong-looking values are legal (a huge top_k on a server that clamps it);
- raw: bytes that are not a request (invalid UTF-8, cut JSON, NaN, deep nesting, digits past
  Python's limit), other content types, other methods;
and it may go to the keyed server with a right, missing, wrong or malformed Authorization header
(any but the right one must be a 401, whatever the body).
"""
import json
import random
from dataclasses import dataclass, field

API_KEY = "fuzz-key-0123"
MODEL_NAMES = ("smol", "smol-alias")       # test_server_support.NAMES
AUTHS = ("right", "missing", "wrong", "malformed")


@dataclass
class Case:
    index: int
    route: str                   # "completions" | "chat" | "tokenize" | "detokenize"
    method: str
    path: str
    raw: bytes
    headers: dict
    form: str                    # "valid" | "mutated" | "raw"
    auth: str | None             # None: the keyless server; else one of AUTHS on the keyed one
    stream: bool = False
    expect_choices: int | None = None     # valid completions/chat: prompts x n
    max_tokens: int | None = None
    mutated: list = field(default_factory=list)   # the fields a mutated case changed

    @property
    def must_succeed(self) -> bool:
        return self.form == "valid" and self.auth in (None, "right")

    @property
    def must_401(self) -> bool:
        return self.auth not in (None, "right")

    def describe(self) -> str:
        shown = self.raw[:600].decode("utf-8", "backslashreplace")
        return (f"case {self.index} ({self.form}, auth={self.auth}, mutated={self.mutated}): "
                f"{self.method} {self.path} headers={self.headers} body={shown}"
                + (f"... ({len(self.raw)} bytes)" if len(self.raw) > 600 else ""))


# -- values ---------------------------------------------------------------------------------------
WORDS = ["Hi", "The capital of France is", "hello world", "1 2 3", "café", "日本語", "emoji 🎉", "a\nb",
         "<|im_start|>", "<|endoftext|>", " ", "tab\there", "x" * 40, "Once upon a time"]
TEMPLATES = ["{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
             "{% if add_generation_prompt %}assistant:{% endif %}",
             "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}",
             "{% for m in messages %}[{{ m.role | upper }}] {{ m.content | trim }}{% endfor %}"]
HUGE_INTS = [2 ** 31, 2 ** 31 - 1, 2 ** 32, 2 ** 53 + 1, 2 ** 63 - 1, 2 ** 63, 2 ** 64, 2 ** 64 - 1, 2 ** 65,
             10 ** 30, 2 ** 200, -2 ** 31, -2 ** 63, -2 ** 63 - 1, -2 ** 64, -10 ** 30, -(2 ** 200)]
HUGE_FLOATS = [1e30, -1e30, 1e308, -1e308, 5e-324, -5e-324, 1.7976931348623157e308, 2.0 ** 63, 1e19]
NAN_LIKE = ["NaN", "nan", "Infinity", "-Infinity", "inf", "1e309", "-0", "0x10", "１", "", " ", "null",
            "true", "12abc"]
SURROGATE = "\ud800 text"          # valid JSON (an escape), invalid Unicode


def _text(r: random.Random, lo=1, hi=3) -> str:
    return " ".join(r.choice(WORDS) for _ in range(r.randint(lo, hi)))


def _garbage(r: random.Random, depth=0):
    """Any JSON value, weighted to the ones that break parsers and packers."""
    k = r.randrange(14 if depth < 3 else 10)
    if k == 0:
        return r.choice(HUGE_INTS)
    if k == 1:
        return r.choice(HUGE_FLOATS)
    if k == 2:
        return r.choice(NAN_LIKE)
    if k == 3:
        return r.choice([None, True, False, 0, -1, 1, 0.5, -0.0, ""])
    if k == 4:
        return SURROGATE
    if k == 5:
        return r.randint(-1000, 1000)
    if k == 6:
        return r.uniform(-10, 10)
    if k == 7:
        return "".join(chr(r.randint(1, 0x2FFF)) for _ in range(r.randint(0, 12)))
    if k == 8:
        return "y" * r.choice([1000, 100_000])
    if k == 9:
        return _text(r)
    if k in (10, 11):
        return [_garbage(r, depth + 1) for _ in range(r.randint(0, 4))]
    if k == 12:
        return {r.choice(["type", "text", "role", "", "x", SURROGATE]): _garbage(r, depth + 1)
                for _ in range(r.randint(0, 3))}
    return {"a": [{"b": [[[[_garbage(r, depth + 1)]]]]}]}


# Wrong values a field is likely to be checked against (its type, range, shape), beside _garbage.
def _edge(r: random.Random, name: str, vocab: int, max_len: int):
    ints = {"max_tokens": [0, -1, max_len, max_len + 1, 10 ** 9], "max_completion_tokens": [0, -1, max_len, 10 ** 9],
            "top_k": [-2, 0, vocab, vocab + 1, 2 ** 31, 2 ** 63, 10 ** 30, -2 ** 63],
            "seed": [-2 ** 63 - 1, 2 ** 64, 2 ** 64 - 1, -2 ** 63, 10 ** 30, 1.5, 2.0 ** 64],
            "n": [0, -1, 129, 128, 10 ** 6, 2 ** 63], "best_of": [0, 2, 200, 2 ** 63],
            "logprobs": [-1, 21, 10 ** 6, True, 2 ** 63], "top_logprobs": [-1, 21, 10 ** 6, 2 ** 63],
            "min_tokens": [-1, 10 ** 6, 2 ** 63], "temperature": [-0.1, 1e308, 2 ** 63, -1e308, 1e-320],
            "top_p": [0, -0.1, 1.0001, 1e308, 5e-324], "min_p": [-0.1, 1.1, 5e-324, 1e308],
            "presence_penalty": [0.5, -2, 1e308], "frequency_penalty": [0.5, -2, 1e308],
            "repetition_penalty": [0, 1.5, -1, 1e308]}
    if name in ints:
        return r.choice(ints[name])
    if name == "stop":
        return r.choice(["", [""], ["x"] * 17, ["z" * 1025], [1, 2], SURROGATE, [SURROGATE], {"a": 1}])
    if name in ("stop_token_ids", "prompt_ids", "tokens"):
        return r.choice([[vocab], [-1], [2 ** 63], [10 ** 30], [1.5], [True], [[1]], ["1"], [vocab - 1, vocab],
                         list(range(5000)), [0] * 300_000])
    if name == "logit_bias":
        return r.choice([{"1": 5}, {"x": 1}, {str(vocab): 100}, {"1": 1e308}, [1, 2]])
    if name == "stream_options":
        return r.choice([{"include_usage": "yes"}, {"continuous_usage_stats": 1}, [], "x"])
    if name == "response_format":
        return r.choice([{"type": "json_object"}, {"type": "json_schema", "json_schema": {}}, "text", {}])
    if name == "tools":
        return r.choice([{"type": "function"}, [1], [{"function": {"name": SURROGATE}}], "x"])
    if name == "tool_choice":
        return r.choice(["required", {"type": "function", "function": {"name": "f"}}, 1, "any"])
    if name == "chat_template":
        return r.choice(["{% for %}", "{{ raise_exception('no') }}", "{{ messages[0]['content'] + 1 }}",
                         "{{ ''.__class__.__mro__[1].__subclasses__() }}", "{{ x.y.z() }}", "{% if %}",
                         "{{ cycler.__init__.__globals__ }}", "{% for i in range(10**6) %}{% endfor %}",
                         "", SURROGATE, "{{ messages | tojson(indent=2) }}"])
    if name == "chat_template_kwargs":
        return r.choice([[], "x", {"x": SURROGATE}, {"messages": 1}, {"add_generation_prompt": "x"},
                         {"enable_thinking": True}, {"tools": [SURROGATE]}])
    if name == "suffix":
        return r.choice(["abc", 1, SURROGATE])
    return _garbage(r)


# -- valid bodies ---------------------------------------------------------------------------------
def _common(r: random.Random, body: dict, vocab: int, max_tokens: int, n: int):
    """The sampling fields both generation routes share, each present half the time."""
    def maybe(name, value):
        if r.random() < 0.4:
            body[name] = value
    maybe("model", r.choice(MODEL_NAMES))
    body["temperature"] = r.choice([0, 0.0, 1e-6, r.uniform(0, 2), 1, None]) if r.random() < 0.7 else None
    maybe("top_p", r.choice([1, r.uniform(0.05, 1)]))
    maybe("top_k", r.choice([-1, 0, 1, r.randint(2, 50), vocab]))
    maybe("min_p", r.choice([0, r.uniform(0, 1)]))
    maybe("seed", r.choice([0, r.randint(0, 2 ** 31), 2 ** 63 - 1, -2 ** 63, -1, r.randint(-2 ** 63, 2 ** 63 - 1)]))
    if n > 1 or r.random() < 0.3:
        body["n"] = n
    maybe("best_of", n)
    maybe("stop", r.choice(["\n", ["."], [",", "!", "the"], ["x" * 30]]))
    maybe("stop_token_ids", [r.randrange(vocab) for _ in range(r.randint(0, 3))])
    maybe("ignore_eos", r.random() < 0.5)
    maybe("skip_special_tokens", r.random() < 0.5)
    maybe("spaces_between_special_tokens", True)
    maybe("min_tokens", r.randint(0, max_tokens))
    maybe("presence_penalty", r.choice([0, 0.0]))
    maybe("frequency_penalty", r.choice([0, 0.0]))
    maybe("repetition_penalty", r.choice([1, 1.0]))
    maybe("logit_bias", {})
    maybe("response_format", {"type": "text"})
    maybe("user", r.choice(["", "user-1", "ユーザー"]))
    maybe("use_beam_search", False)
    maybe("include_stop_str_in_output", False)
    if r.random() < 0.3:                          # clients send fields nobody knows
        body[r.choice(["metadata", "store", "x_custom", "priority_hint"])] = _garbage(r)
    stream = r.random() < 0.3
    if stream or r.random() < 0.2:
        body["stream"] = stream
    if stream and r.random() < 0.5:
        body["stream_options"] = {"include_usage": r.random() < 0.5, "continuous_usage_stats": r.random() < 0.5}
    return stream


def _prompt(r: random.Random, vocab: int):
    k = r.randrange(4)
    if k == 0:
        return _text(r), 1
    if k == 1:
        xs = [_text(r) for _ in range(r.randint(1, 2))]
        return xs, len(xs)
    if k == 2:
        return [r.randrange(vocab) for _ in range(r.randint(1, 8))], 1
    xs = [[r.randrange(vocab) for _ in range(r.randint(1, 6))] for _ in range(r.randint(1, 2))]
    return xs, len(xs)


def valid_completion(r: random.Random, vocab: int) -> tuple[dict, int, int, bool]:
    """(body, choices expected, max_tokens, stream)."""
    prompt, prompts = _prompt(r, vocab)
    n = r.choice([1, 1, 1, 2])
    body = {"prompt": prompt}
    echo = r.random() < 0.15
    max_tokens = r.randint(0 if echo else 1, 4)
    body["max_tokens"] = max_tokens
    stream = _common(r, body, vocab, max(max_tokens, 0), n)
    if echo:
        body["echo"] = True
    elif r.random() < 0.1:
        body["echo"] = False
    if r.random() < 0.3:
        body["logprobs"] = r.randint(0, 5)
    if r.random() < 0.1:
        body["suffix"] = ""
    return body, prompts * n, max_tokens, stream


def _messages(r: random.Random, vocab: int) -> tuple[list, bool]:
    """(messages, ends with an assistant text message)."""
    out = []
    if r.random() < 0.4:
        out.append({"role": r.choice(["system", "developer"]), "content": _text(r)})
    for _ in range(r.randint(1, 3)):
        k = r.randrange(3)
        if k == 0:
            content = _text(r)
        elif k == 1:
            content = [{"type": "text", "text": _text(r)} for _ in range(r.randint(1, 3))]
        else:
            content = [_text(r), {"type": "text", "text": _text(r)}]
        m = {"role": r.choice(["user", "user", "assistant", "tool"]), "content": content}
        if r.random() < 0.2:
            m["name"] = r.choice(["alice", "bob_2"])
        out.append(m)
    final_assistant = r.random() < 0.2
    if final_assistant:
        out.append({"role": "assistant", "content": "The answer is"})
    elif out[-1]["role"] == "assistant":
        out.append({"role": "user", "content": _text(r)})
    return out, final_assistant


TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                         "parameters": {"type": "object", "properties": {
                                             "city": {"type": "string"}}, "required": ["city"]}}}


def _chat_extras(r: random.Random, body: dict, final_assistant: bool):
    """The template fields chat and /tokenize's messages form share."""
    if r.random() < 0.2:
        body["tools"] = [TOOL]
    if r.random() < 0.2 or "tools" in body:
        # the fuzzed server (SmolLM2) has no tool parser: tools with "auto" are vLLM's 400
        body["tool_choice"] = "none" if "tools" in body else r.choice(["none", "auto"])
    if r.random() < 0.15:
        body["chat_template"] = r.choice(TEMPLATES)
    if r.random() < 0.2:
        body["chat_template_kwargs"] = r.choice([{"enable_thinking": False}, {"custom": "v"}, {}])
    if r.random() < 0.1:
        body["documents"] = [{"title": "t", "text": _text(r)}]
    if final_assistant and r.random() < 0.5:
        body["continue_final_message"] = True
        if r.random() < 0.5:
            body["add_generation_prompt"] = False
    elif r.random() < 0.2:
        body["add_generation_prompt"] = r.random() < 0.5


def valid_chat(r: random.Random, vocab: int) -> tuple[dict, int, int, bool]:
    messages, final_assistant = _messages(r, vocab)
    body = {"messages": messages}
    n = r.choice([1, 1, 1, 2])
    max_tokens = r.randint(1, 4)
    which = r.random()
    if which < 0.45:
        body["max_tokens"] = max_tokens
    elif which < 0.9:
        body["max_completion_tokens"] = max_tokens
    else:
        body["max_tokens"], body["max_completion_tokens"] = r.randint(1, 4), max_tokens
    stream = _common(r, body, vocab, max_tokens, n)
    _chat_extras(r, body, final_assistant)
    if r.random() < 0.3:
        body["logprobs"] = True
        if r.random() < 0.7:
            body["top_logprobs"] = r.randint(0, 5)
    elif r.random() < 0.1:
        body["logprobs"] = False
    if r.random() < 0.05:
        body["echo"] = False
    return body, n, max_tokens, stream


def valid_tokenize(r: random.Random, vocab: int) -> dict:
    if r.random() < 0.6:
        body = {"prompt": _text(r, 1, 5)}
    else:
        messages, final_assistant = _messages(r, vocab)
        body = {"messages": messages}
        _chat_extras(r, body, final_assistant)
    if r.random() < 0.4:
        body["add_special_tokens"] = r.random() < 0.5
    if r.random() < 0.4:
        body["return_token_strs"] = r.random() < 0.5
    if r.random() < 0.4:
        body["model"] = r.choice(MODEL_NAMES)
    return body


def valid_detokenize(r: random.Random, vocab: int) -> dict:
    body = {"tokens": [r.randrange(vocab) for _ in range(r.randint(0, 12))]}
    if r.random() < 0.4:
        body["model"] = r.choice(MODEL_NAMES)
    return body


FIELDS = {     # what a mutation may hit, per route: every field the route reads, and the required ones
    "completions": ["prompt", "model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "n",
                    "best_of", "stop", "stop_token_ids", "stream", "stream_options", "logprobs", "echo",
                    "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "min_tokens",
                    "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "user",
                    "suffix", "response_format", "use_beam_search", "include_stop_str_in_output"],
    "chat": ["messages", "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
             "min_p", "seed", "n", "best_of", "stop", "stop_token_ids", "stream", "stream_options", "logprobs",
             "top_logprobs", "echo", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
             "min_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "user",
             "response_format", "tools", "tool_choice", "chat_template", "chat_template_kwargs", "documents",
             "add_generation_prompt", "continue_final_message"],
    "tokenize": ["prompt", "messages", "add_special_tokens", "return_token_strs", "model", "chat_template",
                 "chat_template_kwargs", "tools", "add_generation_prompt", "continue_final_message"],
    "detokenize": ["tokens", "model"],
}
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions", "tokenize": "/tokenize",
         "detokenize": "/detokenize"}


def _bad_prompt(r: random.Random, vocab: int, max_len: int):
    return r.choice([[], "", [[]], [[1], []], [vocab], [-1], [2 ** 63], [10 ** 30], [1.0, 2.0], [True, 1],
                     ["a", 1], [["a"]], [[1, 2], "x"], [1] * max_len, [[1]] * 257, ["a"] * 129,
                     "word " * 5000, [[r.randrange(vocab)] for _ in range(100)], SURROGATE, [SURROGATE],
                     {"text": "x"}, 1, [[vocab + 5]], [[1, [2]]]])


def _bad_messages(r: random.Random):
    return r.choice([[], {}, "hi", [1], [None], [{"content": "x"}], [{"role": "", "content": "x"}],
                     [{"role": 1, "content": "x"}], [{"role": "user"}], [{"role": "user", "content": 1}],
                     [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}],
                     [{"role": "user", "content": [{"type": "text"}]}], [{"role": "user", "content": [1]}],
                     [{"role": "user", "content": SURROGATE}], [{"role": SURROGATE, "content": "x"}],
                     [{"role": "user", "content": "x", "name": SURROGATE}],
                     [{"role": "assistant", "content": None}], [{"role": "assistant"}],
                     [{"role": "user", "content": "x", SURROGATE: 1}],
                     [{"role": "user", "content": "x"}] * 3000,
                     [{"role": "user", "content": "z " * 20000}],
                     [{"role": "user", "content": {"type": "text", "text": "x"}}],
                     [{"role": "user", "content": "x", "tool_calls": [{"id": 1}]}]])


# Absent, null or a legal size, these make a long and legitimate generation (chat's default runs to
# the end of the context), which the storm's stall bound would count against the server.
LENGTH_FIELDS = ("max_tokens", "max_completion_tokens")


def _legal_length(v, max_len: int) -> bool:
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < max_len)


def mutate(r: random.Random, route: str, body: dict, vocab: int, max_len: int) -> list:
    """Change one to three fields of body in place; returns their names."""
    names = r.sample(FIELDS[route], min(len(FIELDS[route]), r.choice([1, 1, 1, 2, 3])))
    for name in names:
        k = r.random()
        if name in LENGTH_FIELDS:
            v = _garbage(r) if k < 0.5 else None
            body[name] = v if not _legal_length(v, max_len) else _edge(r, name, vocab, max_len)
        elif k < 0.1:
            body.pop(name, None)                  # absent (a required field: a 400)
        elif name == "prompt" and k < 0.7:
            body[name] = _bad_prompt(r, vocab, max_len)
        elif name == "messages" and k < 0.7:
            body[name] = _bad_messages(r)
        elif k < 0.65:
            body[name] = _edge(r, name, vocab, max_len)
        else:
            body[name] = _garbage(r)
    if r.random() < 0.01:     # ... and sometimes many copies of the request (rare: the legal ones cost)
        body["n"] = r.choice([64, 128])
        if route == "completions":
            body["prompt"] = [_text(r)] * r.choice([2, 128, 256])
    return names


def dumps(body) -> bytes:
    return json.dumps(body, allow_nan=False).encode("utf-8", "surrogatepass")


RAW_BODIES = [b"", b"{", b"}", b"null", b"[]", b"[1,2]", b'"str"', b"1", b"true", b'{"prompt": NaN}',
              b'{"prompt": "x", "max_tokens": Infinity}', b'{"prompt": "x", "temperature": -Infinity}',
              b'{"prompt": "x", "n": 1e400}', b'{"prompt": "x", "seed": ' + b"9" * 5000 + b"}",
              b'{"prompt": "x", "top_k": ' + b"1" * 4000 + b"}", b"[" * 100_000 + b"]" * 100_000,
              b'{"a":' * 50_000 + b"1" + b"}" * 50_000, b"\xc3\x28", b'{"prompt": "\xff\xfe"}',
              b'{"prompt": "x"' + b" " * 10_000, b'{"prompt": "x", "prompt": [1]}', b"\x00" * 100,
              b'{"prompt": "\\ud800\\udc00\\udbff"}', b'\xef\xbb\xbf{"prompt": "x", "max_tokens": 1}',
              b'{"messages": [{"role": "user", "content": "\\u0000"}], "max_tokens": 1}']
CONTENT_TYPES = ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                 "application/json; charset=latin-1", "application/jsonx", "", "*/*", "APPLICATION/JSON"]


def _raw(r: random.Random, route: str, body: dict) -> bytes:
    k = r.randrange(4)
    if k == 0:
        return r.choice(RAW_BODIES)
    raw = dumps(body)
    if k == 1:
        return raw[:r.randrange(max(1, len(raw)))]         # cut short
    if k == 2:                                             # an invalid UTF-8 byte inside
        at = r.randrange(len(raw) + 1)
        return raw[:at] + r.choice([b"\xff", b"\xc0\xaf", b"\xed\xa0\x80", b"\x80"]) + raw[at:]
    return raw.replace(b'"', b"'", 1)                     # JSON-ish


def _auth_headers(r: random.Random, auth: str | None) -> dict:
    if auth in (None, "missing"):
        return {}
    if auth == "right":
        return {"Authorization": r.choice(["Bearer ", "bearer ", "BEARER "]) + API_KEY}
    if auth == "wrong":
        return {"Authorization": "Bearer " + r.choice(["", "x", API_KEY[:-1], API_KEY + "x", API_KEY.upper(),
                                                       "fuzz-key-0124", "k" * 4000])}
    return {"Authorization": r.choice([API_KEY, "Basic " + API_KEY, "Bearer" + API_KEY, "Token " + API_KEY,
                                       "Bearer\t" + API_KEY, "Bearer  " + API_KEY, "Bearer " + API_KEY + ",x",
                                       "Bearer " + API_KEY + "\u00e9", "\u00ff" * 10])}


def make_case(seed: int, i: int, vocab: int, max_len: int, valid_share: float = 0.12,
              keyed_share: float = 0.2) -> Case:
    r = random.Random(f"{seed}:{i}")
    route = r.choices(["completions", "chat", "tokenize", "detokenize"], [4, 4, 1.2, 0.8])[0]
    headers = {"Content-Type": "application/json"}
    auth = r.choice(AUTHS) if r.random() < keyed_share else None
    headers.update(_auth_headers(r, auth))
    choices = max_tokens = None
    stream = False
    if route == "completions":
        body, choices, max_tokens, stream = valid_completion(r, vocab)
    elif route == "chat":
        body, choices, max_tokens, stream = valid_chat(r, vocab)
    elif route == "tokenize":
        body = valid_tokenize(r, vocab)
    else:
        body = valid_detokenize(r, vocab)
    method, mutated = "POST", []
    u = r.random()
    if u < valid_share:
        form, raw = "valid", dumps(body)
    elif u < valid_share + (1 - valid_share) * 0.8:
        form = "mutated"
        mutated = mutate(r, route, body, vocab, max_len)
        raw = dumps(body)
    else:
        form = "raw"
        raw = _raw(r, route, body)
        if r.random() < 0.25:
            ct = r.choice(CONTENT_TYPES)
            if ct:
                headers["Content-Type"] = ct
            else:
                del headers["Content-Type"]
            raw = dumps(body)
        if r.random() < 0.05:
            method = r.choice(["GET", "PUT", "DELETE", "PATCH"])
    return Case(i, route, method, PATHS[route], raw, headers, form, auth, stream and form == "valid",
                choices, max_tokens, mutated)
