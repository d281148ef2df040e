"""The OpenAI protocol: request bodies in, checked; errors out, in OpenAI's shape.

Bodies are parsed by hand rather than by pydantic models, so that every bad request is a 400
with a message naming the field (never FastAPI's 422, never a 500), and so that each field's
rule is stated once, here. Unknown fields are ignored (clients send many); fields this server
knows but does not implement (beam search, ...) are errors when set to
anything but their neutral value, rather than silently dropped.

Every number is bounded where the engine packs it (runtime/cuda/sampler.py: top_k as int32,
temperature / top_p / min_p as float32, the seed as 64 bits): top_k at most the vocabulary (vLLM's
rule), the seed a signed 64-bit integer (vLLM's range), temperature finite in float32, and a
top_p that float32 would round to 0 raised to float32's smallest normal (either keeps only the
likeliest token); n, logprobs and top_logprobs by the server's limits; max_tokens, min_tokens and the
prompt by the context; token ids by the vocabulary.

Cheap bounds first (parse_completion, parse_chat): every field, and what can never fit, before
anything grows with the request's size. A text prompt longer than max_model_len x the longest
token's characters (vLLM's bound: Limits.max_prompt_chars) is the context-length 400 at once, as
is a token-id list of max_model_len ids or more; only then is text tokenized and each id
checked. All of it runs on the server's worker pool (offload.py), never on the event loop.
"""
import json
import math
from dataclasses import dataclass

from infc.runtime.engine.sampling import SamplingParams

from . import chat, sampling_fields

# Below this temperature sampling is greedy (vLLM's _SAMPLING_EPS): logits / 1e-300 overflow.
GREEDY_BELOW = 1e-5
MAX_STOP = 16                    # stop strings per request
MAX_STOP_LEN = 1024              # characters per stop string
MAX_STOP_IDS = 4096
MAX_PROMPTS = 256                # prompts in one completions request
MAX_DETOKENIZE = 1 << 20         # ids in one /detokenize request
F32_MAX = 3.4028234663852886e38  # the sampler's float32 fields hold no more
F32_TINY = 1.1754943508222875e-38  # float32's smallest normal: a top_p below it would round to 0
SEED_RANGE = (-2 ** 63, 2 ** 63)   # vLLM's: a signed 64-bit integer


class APIError(Exception):
    """An error response: {"error": {"message", "type", "param", "code"}} with this status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | int | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def _no_constant(name):
    raise ValueError(f"{name} is not valid JSON")


def parse_json(raw: bytes) -> dict:
    try:
        text = raw.decode("utf-8")
        body = json.loads(text, parse_constant=_no_constant)
    except UnicodeDecodeError:
        raise bad("the request body is not valid UTF-8") from None
    except RecursionError:
        raise bad("the request body nests too deeply") from None
    except ValueError as e:       # JSONDecodeError, NaN/Infinity, ints past the digit limit
        raise bad(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    return body


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def check_text(s: str, param: str) -> str:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise bad(f"'{param}' holds an unpaired surrogate: not valid Unicode", param) from None
    return s


class Fields:
    """Typed reads of an object's fields; null means absent."""

    def __init__(self, body: dict):
        self.body = body

    def get(self, name):
        return self.body.get(name)

    def int(self, name, default=None, lo=None, hi=None):
        v = self.body.get(name)
        if v is None:
            return default
        if isinstance(v, float) and v.is_integer() and abs(v) < 2 ** 53:
            v = int(v)
        if not _is_int(v):
            raise bad(f"'{name}' must be an integer, got {_show(v)}", name)
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise bad(f"'{name}' must be {_range(lo, hi)}, got {v}", name)
        return v

    def float(self, name, default=None, lo=None, hi=None, lo_open=False):
        v = self.body.get(name)
        if v is None:
            return default
        if not _is_num(v):
            raise bad(f"'{name}' must be a finite number, got {_show(v)}", name)
        v = float(v)
        if (lo is not None and (v < lo or (lo_open and v == lo))) or (hi is not None and v > hi):
            raise bad(f"'{name}' must be {_range(lo, hi, lo_open)}, got {v}", name)
        return v

    def bool(self, name, default=False):
        v = self.body.get(name)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise bad(f"'{name}' must be a boolean, got {_show(v)}", name)
        return v

    def str(self, name, default=None):
        v = self.body.get(name)
        if v is None:
            return default
        if not isinstance(v, str):
            raise bad(f"'{name}' must be a string, got {_show(v)}", name)
        return check_text(v, name)

    def dict(self, name):
        v = self.body.get(name)
        if v is None:
            return {}
        if not isinstance(v, dict):
            raise bad(f"'{name}' must be an object, got {_show(v)}", name)
        return v


def _show(v) -> str:
    s = json.dumps(v, ensure_ascii=True) if not isinstance(v, float) else repr(v)
    return type(v).__name__ + " " + (s if len(s) <= 40 else s[:37] + "...")


def _range(lo, hi, lo_open=False) -> str:
    if lo is not None and hi is not None:
        return f"in {'(' if lo_open else '['}{lo}, {hi}]"
    if lo is not None:
        return f"{'>' if lo_open else '>='} {lo}"
    return f"<= {hi}"


# -- what a checked request is ------------------------------------------------------------------
@dataclass
class GenRequest:
    kind: str                          # "completion" | "chat"
    prompts: list                      # token id lists, one engine request each
    texts: list                        # the prompt text per prompt (None for token ids)
    params: SamplingParams | None      # None: nothing to generate (echo with max_tokens 0)
    n: int
    echo: bool = False
    logprobs: int | None = None        # top alternatives per token; None: no logprobs
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    max_tokens: int | None = None
    answer: object = None              # chat: its chat_output.AnswerPlan (outputs.py)
    prompt_logprobs: int | None = None # vLLM's: the prompt's logprobs with the top k (server/scoring.py)
    cache_salt: str | None = None      # vLLM's: only requests with the same salt share cached KV


@dataclass
class Limits:
    max_model_len: int
    vocab_size: int
    max_logprobs: int = 20
    max_n: int = 128
    max_prompt_chars: int | None = None    # longer text can never fit (None: no tokenizer)


def prompt_char_bound(tokenizer, max_model_len: int) -> int | None:
    """vLLM's max_model_len x max_chars_per_token (runtime Tokenizer.max_token_chars)."""
    return None if tokenizer is None else max_model_len * tokenizer.max_token_chars


_UNSUPPORTED = {                       # field -> its neutral values (anything else is a 400)
    "use_beam_search": (False,), "length_penalty": (1, 1.0),
    "logits_processors": (), "truncate_prompt_tokens": (),
    "prompt_embeds": (), "spaces_between_special_tokens": (True,), "suffix": ("",),
}


def _reject_unsupported(body: dict):
    for name, neutral in _UNSUPPORTED.items():
        v = body.get(name)
        if v is None or any(v == n and type(v) is type(n) for n in neutral):
            continue
        if name == "length_penalty" and \
                _is_num(v) and float(v) == float(neutral[0]):
            continue
        raise bad(f"'{name}' is not supported by this server", name)


def _cache_salt(f: Fields) -> str | None:
    """vLLM's cache_salt: the request's cached KV is shared only with requests of the same salt
    (the block manager names its blocks with it); vLLM's words where it is not a string."""
    v = f.get("cache_salt")
    if v is None:
        return None
    if not isinstance(v, str) or not v:
        raise bad("Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt")
    return check_text(v, "cache_salt")


def _prompt_logprobs(f: Fields, lim: Limits, stream: bool) -> int | None:
    k = f.int("prompt_logprobs", None, 0, lim.max_logprobs)
    if k and stream:                   # vLLM's rule and words
        raise bad("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")
    return k


def _stop(f: Fields) -> list[str]:
    v = f.get("stop")
    if v is None:
        return []
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise bad("'stop' must be a string or a list of strings", "stop")
    if len(items) > MAX_STOP:
        raise bad(f"'stop' holds at most {MAX_STOP} strings, got {len(items)}", "stop")
    for s in items:
        if not s or len(s) > MAX_STOP_LEN:
            raise bad(f"each stop string must have 1 to {MAX_STOP_LEN} characters", "stop")
        check_text(s, "stop")
    return list(items)


def token_ids(v, name: str, vocab: int, cap: int) -> list[int]:
    """A checked list of token ids: its length first (cheap), then every id."""
    if not isinstance(v, list):
        raise bad(f"'{name}' must be a list of integers", name)
    if len(v) > cap:
        raise bad(f"'{name}' holds at most {cap} ids, got {len(v)}", name)
    if not all(_is_int(t) for t in v):
        raise bad(f"'{name}' must be a list of integers", name)
    if not all(0 <= t < vocab for t in v):
        raise bad(f"'{name}' ids must be in [0, {vocab})", name)
    return list(v)


def _sampling(f: Fields, lim: Limits, max_tokens: int | None, n: int, logprobs: int | None,
              stop_allowed: bool, best_of: int | None = None) -> SamplingParams:
    temperature = f.float("temperature", 1.0, 0.0, F32_MAX)
    if temperature < GREEDY_BELOW:
        temperature = 0.0
    seed = f.int("seed")
    if seed is not None:
        if not SEED_RANGE[0] <= seed < SEED_RANGE[1]:
            raise bad(f"'seed' must be a signed 64-bit integer, in [-2**63, 2**63), got {_show(seed)}", "seed")
        seed %= 2 ** 64                    # negative seeds (int64) map to the same 64-bit draw
    stop = _stop(f)
    if stop and not stop_allowed:
        raise bad("'stop' needs a tokenizer, and this model has none", "stop")
    min_tokens = f.int("min_tokens", 0, 0, lim.max_model_len)
    if max_tokens is not None and min_tokens > max_tokens:
        raise bad(f"'min_tokens' ({min_tokens}) must be <= max_tokens ({max_tokens})", "min_tokens")
    top_k = f.int("top_k", 0, -1, lim.vocab_size)      # vLLM: "top_k cannot be greater than vocabulary size"
    top_p = max(f.float("top_p", 1.0, 0.0, 1.0, lo_open=True), F32_TINY)
    try:
        return SamplingParams(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p,
            top_k=top_k, min_p=f.float("min_p", 0.0, 0.0, 1.0), seed=seed, stop=stop,
            stop_token_ids=[] if f.get("stop_token_ids") is None else token_ids(
                f.get("stop_token_ids"), "stop_token_ids", lim.vocab_size, MAX_STOP_IDS),
            ignore_eos=f.bool("ignore_eos"), min_tokens=min_tokens, n=n, logprobs=logprobs,
            skip_special_tokens=f.bool("skip_special_tokens", True), best_of=best_of,
            **_extra(sampling_fields.processing, f, lim.vocab_size, stop_allowed, F32_MAX))
    except ValueError as e:
        raise bad(str(e)) from None


def _extra(parse, *args):
    """A sampling_fields parser's result; its FieldError as this module's 400."""
    try:
        return parse(*args)
    except sampling_fields.FieldError as e:
        raise bad(str(e), e.param) from None


def _check_context(lim: Limits, n_prompt: int, max_tokens: int | None, what: str):
    N = lim.max_model_len
    if n_prompt >= N:
        raise bad(f"This model's maximum context length is {N} tokens. However, your request has "
                  f"{n_prompt} input tokens ({what}), and at least one token must be generated. "
                  f"Please reduce the length of the input.", "messages" if what == "messages" else "prompt",
                  "context_length_exceeded")
    if max_tokens is not None and n_prompt + max_tokens > N:
        raise bad(f"This model's maximum context length is {N} tokens. However, you requested "
                  f"{n_prompt + max_tokens} tokens ({n_prompt} in the {what}, {max_tokens} in the "
                  f"completion). Please reduce the length of the {what} or completion.",
                  "max_tokens", "context_length_exceeded")


def _stream_options(f: Fields, stream: bool) -> tuple[bool, bool]:
    opts = f.dict("stream_options")
    if opts and not stream:
        raise bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
    o = Fields(opts)
    return o.bool("include_usage"), o.bool("continuous_usage_stats")


def _n(f: Fields, lim: Limits) -> int:
    return f.int("n", 1, 1, lim.max_n)


def _check_chars(lim: Limits, text: str, what: str):
    """The cheap bound: refuse, before tokenizing it, a text that can never fit."""
    cap, N = lim.max_prompt_chars, lim.max_model_len
    if cap is not None and len(text) > cap:
        raise bad(f"This model's maximum context length is {N} tokens. However, your request has "
                  f"{len(text)} characters ({what}), more than {N} tokens of this tokenizer can hold "
                  f"(at most {cap // N} characters each). Please reduce the length of the input.",
                  "messages" if what == "messages" else "prompt", "context_length_exceeded")


def _check_max_tokens(lim: Limits, max_tokens: int | None, what: str):
    """The cheap bound on the completion: the prompt takes at least one token of the context."""
    N = lim.max_model_len
    if max_tokens is not None and max_tokens >= N:
        raise bad(f"This model's maximum context length is {N} tokens. However, you requested "
                  f"{max_tokens} tokens in the completion, and the {what} takes at least one. "
                  f"Please reduce the length of the completion.", "max_tokens", "context_length_exceeded")


# -- /v1/completions ----------------------------------------------------------------------------
_PROMPT_FORMS = ("'prompt' must be a string, a list of strings, a list of token ids or a list of "
                 "lists of token ids (and not empty)")


def _prompt_forms(p) -> list:
    """The prompts of a completions request, told apart by the first element (each is checked
    in full later, after the cheap bounds: a list of a million ids is not walked to refuse it)."""
    if p is None:
        raise bad("'prompt' is required", "prompt")
    if isinstance(p, str):
        return [p]
    if not isinstance(p, list) or not p:
        raise bad(_PROMPT_FORMS, "prompt")
    if _is_int(p[0]):
        return [p]
    if not isinstance(p[0], (str, list)):
        raise bad(_PROMPT_FORMS, "prompt")
    if len(p) > MAX_PROMPTS:
        raise bad(f"'prompt' holds at most {MAX_PROMPTS} prompts, got {len(p)}", "prompt")
    kind = type(p[0])
    if not all(isinstance(x, kind) for x in p):
        raise bad(_PROMPT_FORMS, "prompt")
    return list(p)


def parse_completion(body: dict, lim: Limits, tokenizer) -> GenRequest:
    """Every field first, then the prompts' cheap bounds, then tokenization and the id checks."""
    f = Fields(body)
    _reject_unsupported(body)
    raw = _prompt_forms(body.get("prompt"))
    n = _n(f, lim)
    if len(raw) * n > lim.max_n:
        raise bad(f"a request may ask for at most {lim.max_n} completions (prompts x n), "
                  f"got {len(raw) * n}", "n")
    echo = f.bool("echo")
    max_tokens = f.int("max_tokens", 16, 0)
    lp = body.get("logprobs")
    if isinstance(lp, bool):
        raise bad("'logprobs' must be an integer (the number of alternatives), not a boolean", "logprobs")
    logprobs = f.int("logprobs", None, 0, lim.max_logprobs)
    stream = f.bool("stream")
    include_usage, continuous = _stream_options(f, stream)
    best_of = _extra(sampling_fields.best_of, f, n, lim.max_n, stream)
    if best_of and len(raw) * best_of > lim.max_n:
        raise bad(f"a request may draw at most {lim.max_n} completions (prompts x best_of), "
                  f"got {len(raw) * best_of}", "best_of")
    if max_tokens == 0 and not echo:
        raise bad("'max_tokens' must be >= 1 (0 only with echo)", "max_tokens")
    _check_max_tokens(lim, max_tokens, "prompt")
    f.str("user")
    params = None
    if max_tokens > 0:
        params = _sampling(f, lim, max_tokens, n, logprobs, tokenizer is not None, best_of)
    else:
        _sampling(f, lim, 1, n, logprobs, tokenizer is not None)        # still check every field
    for x in raw:                                                       # what can never fit
        if isinstance(x, str):
            if tokenizer is None:
                raise bad("this model has no tokenizer: send token ids", "prompt")
            _check_chars(lim, x, "prompt")
        elif len(x) >= lim.max_model_len:
            _check_context(lim, len(x), None, "prompt")
    if echo and tokenizer is None and any(not isinstance(x, str) for x in raw):
        raise bad("echo of token-id prompts needs a tokenizer", "echo")
    prompts, texts = [], []
    for x in raw:
        if isinstance(x, str):
            ids = encode(tokenizer, check_text(x, "prompt"), "prompt")
            texts.append(x)
        else:
            ids = token_ids(x, "prompt", lim.vocab_size, lim.max_model_len)
            texts.append(None)
        if not ids:
            raise bad("the prompt is empty", "prompt")
        _check_context(lim, len(ids), max_tokens, "prompt")
        prompts.append(ids)
    return GenRequest("completion", prompts, texts, params, n, echo, logprobs, stream, include_usage,
                      continuous, max_tokens, prompt_logprobs=_prompt_logprobs(f, lim, stream),
                      cache_salt=_cache_salt(f))


def encode(tokenizer, text: str, param: str) -> list[int]:
    try:
        return tokenizer.encode(text)
    except Exception as e:    # noqa: BLE001 - the tokenizers library raises its own types
        raise bad(f"'{param}' cannot be tokenized: {e}", param) from None


# -- /v1/chat/completions -----------------------------------------------------------------------
def messages_for_template(v) -> list[dict]:
    """Checked messages; content parts [{"type": "text", "text": ...}] joined into one string."""
    if not isinstance(v, list) or not v:
        raise bad("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(v):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object", "messages")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise bad(f"messages[{i}].role must be a non-empty string", "messages")
        check_text(role, "messages")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if isinstance(part, str):
                    parts.append(part)
                elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                    parts.append(part["text"])
                else:
                    raise bad(f"messages[{i}].content: only text parts are supported", "messages")
            content = "\n".join(parts)
        elif content is None and role != "assistant":
            # OpenAI's schema: only an assistant message (one carrying tool calls) may omit it
            raise bad(f"messages[{i}].content is required for role '{role}'", "messages")
        elif content is not None and not isinstance(content, str):
            raise bad(f"messages[{i}].content must be a string, a list of text parts or null", "messages")
        if isinstance(content, str):
            check_text(content, "messages")
        msg = {k: val for k, val in m.items() if isinstance(k, str)}
        msg["content"] = "" if content is None else content   # a tool-calling turn: no text
        if isinstance(m.get("tool_calls"), list):
            msg["tool_calls"] = [_call_for_template(c) for c in m["tool_calls"]]
        _check_strings(msg, "messages")
        out.append(msg)
    return out


def _call_for_template(call):
    """An assistant turn's tool call as templates read it (HF's, vLLM's): the arguments an
    object, not OpenAI's JSON text."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        args = json.loads(fn["arguments"])
    except (ValueError, RecursionError):     # not JSON: the template gets the text
        return call
    return dict(call, function=dict(fn, arguments=args))


def _check_strings(v, param, depth=0):
    """Every string inside a JSON value must be valid Unicode (it goes into the template)."""
    if depth > 64:
        raise bad(f"'{param}' nests too deeply", param)
    if isinstance(v, str):
        check_text(v, param)
    elif isinstance(v, dict):
        for k, x in v.items():
            check_text(k, param)
            _check_strings(x, param, depth + 1)
    elif isinstance(v, list):
        for x in v:
            _check_strings(x, param, depth + 1)


def render_chat(body: dict, template: str | None, tokenizer, special: dict, trust_request_template: bool,
                ) -> str:
    f = Fields(body)
    messages = messages_for_template(body.get("messages"))
    req_template = f.str("chat_template")
    if req_template is not None:
        if not trust_request_template:
            raise bad("'chat_template' in a request is refused: start the server with "
                      "--trust-request-chat-template to allow it", "chat_template")
        template = req_template
    if template is None:
        raise bad("this model has no chat template: use /v1/completions, or start the server with "
                  "--chat-template", "messages")
    kwargs = f.dict("chat_template_kwargs")
    _check_strings(kwargs, "chat_template_kwargs")
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise bad("'tools' must be a list of objects", "tools")
    _check_strings(tools, "tools")
    documents = body.get("documents")
    if documents is not None and not isinstance(documents, list):
        raise bad("'documents' must be a list", "documents")
    _check_strings(documents, "documents")
    add_gen = f.bool("add_generation_prompt", True)
    cont = f.bool("continue_final_message", False)
    if add_gen and cont and body.get("add_generation_prompt") is True:
        raise bad("'continue_final_message' and 'add_generation_prompt' cannot both be true",
                  "continue_final_message")
    if cont:
        add_gen = False
    try:
        return chat.render(template, messages, add_generation_prompt=add_gen, continue_final_message=cont,
                           tools=tools, documents=documents, special=special, kwargs=kwargs)
    except chat.TemplateError as e:
        raise bad(str(e), "messages", "chat_template_error") from None


def parse_chat(body: dict, lim: Limits, tokenizer, template: str | None, special: dict,
               trust_request_template: bool = False) -> GenRequest:
    """Every field first, then the template, the rendered text's cheap bound, tokenization."""
    f = Fields(body)
    _reject_unsupported(body)
    if tokenizer is None:
        raise bad("chat needs a tokenizer, and this model has none", "messages")
    if f.bool("echo"):
        raise bad("'echo' is not supported on chat completions", "echo")
    n = _n(f, lim)
    max_tokens = f.int("max_completion_tokens", None, 1)       # the newer name wins ...
    legacy = f.int("max_tokens", None, 1)                       # ... but both must be valid
    if max_tokens is None:
        max_tokens = legacy
    _check_max_tokens(lim, max_tokens, "messages")
    want_lp = f.bool("logprobs")
    top = f.int("top_logprobs", None, 0, lim.max_logprobs)
    if top and not want_lp:
        raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    logprobs = (top or 0) if want_lp else None
    stream = f.bool("stream")
    include_usage, continuous = _stream_options(f, stream)
    f.str("user")
    params = _sampling(f, lim, max_tokens, n, logprobs, True,
                       _extra(sampling_fields.best_of, f, n, lim.max_n, stream))
    text = render_chat(body, template, tokenizer, special, trust_request_template)
    _check_chars(lim, text, "messages")
    try:
        ids = tokenizer.encode_text(text)    # no BOS: the template has the special tokens
    except Exception as e:  # noqa: BLE001
        raise bad(f"the rendered chat cannot be tokenized: {e}", "messages") from None
    if not ids:
        raise bad("the rendered chat is empty", "messages")
    _check_context(lim, len(ids), max_tokens, "messages")
    return GenRequest("chat", [ids], [text], params, n, False, logprobs, stream, include_usage,
                      continuous, max_tokens, prompt_logprobs=_prompt_logprobs(f, lim, stream),
                      cache_salt=_cache_salt(f))
