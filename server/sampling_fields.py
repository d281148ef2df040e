"""The request fields of vLLM's logits processing and best_of, checked: SamplingParams keywords.

Both endpoints take them (vLLM's extra body fields: repetition_penalty, bad_words,
allowed_token_ids, include_stop_str_in_output; OpenAI's presence_penalty, frequency_penalty,
logit_bias, best_of). Ranges are vLLM's: presence and frequency penalties in [-2, 2],
repetition_penalty > 0; logit_bias maps token ids (strings, as JSON keys) to biases clamped to
[-100, 100] as OpenAI does; best_of >= n, never streamed (OpenAI: its candidates are only
ranked once all are done).

`f` is protocol.Fields (its typed reads raise their own 400s); what only these fields check
raises FieldError, which protocol turns into its 400 (this module imports nothing of protocol).
"""
import json
import math

MAX_BAD_WORDS = 128
MAX_BAD_WORD_LEN = 1024
BIAS_RANGE = (-100.0, 100.0)         # OpenAI's: a bias beyond it is clamped


class FieldError(ValueError):
    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def _show(v) -> str:
    s = json.dumps(v, ensure_ascii=True)
    return type(v).__name__ + " " + (s if len(s) <= 40 else s[:37] + "...")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _logit_bias(f, vocab: int) -> dict[int, float] | None:
    raw = f.dict("logit_bias")
    if not raw:
        return None
    if len(raw) > vocab:
        raise FieldError(f"'logit_bias' holds at most {vocab} entries (the vocabulary), got {len(raw)}", "logit_bias")
    out = {}
    for key, v in raw.items():
        try:
            t = int(key)
        except ValueError:
            raise FieldError(f"'logit_bias' keys must be token ids, got {_show(key)}", "logit_bias") from None
        if not 0 <= t < vocab:
            raise FieldError(f"'logit_bias' token id {t} is out of the vocabulary [0, {vocab})", "logit_bias")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise FieldError(f"'logit_bias' values must be finite numbers, got {_show(v)} for {key!r}", "logit_bias")
        out[t] = min(BIAS_RANGE[1], max(BIAS_RANGE[0], float(v)))
    return out


def _bad_words(f, stop_allowed: bool) -> list[str] | None:
    v = f.get("bad_words")
    if v is None or v == []:
        return None
    if not isinstance(v, list) or not all(isinstance(w, str) for w in v):
        raise FieldError("'bad_words' must be a list of strings", "bad_words")
    if len(v) > MAX_BAD_WORDS:
        raise FieldError(f"'bad_words' holds at most {MAX_BAD_WORDS} words, got {len(v)}", "bad_words")
    if not all(w.strip() and len(w) <= MAX_BAD_WORD_LEN for w in v):
        raise FieldError(f"each bad word must have 1 to {MAX_BAD_WORD_LEN} characters, not all blank", "bad_words")
    if not stop_allowed:
        raise FieldError("'bad_words' need a tokenizer, and this model has none", "bad_words")
    return list(v)


def best_of(f, n: int, max_n: int, stream: bool) -> int | None:
    """best_of, checked against n; None where it asks for nothing more than n."""
    b = f.int("best_of", None, 1, max_n)
    if b is None or b == n:
        return None
    if b < n:
        raise FieldError(f"'best_of' ({b}) must be >= n ({n})", "best_of")
    if stream:
        raise FieldError("'best_of' > n cannot be streamed: its completions are ranked once all are done", "best_of")
    return b


def processing(f, vocab: int, stop_allowed: bool, f32_max: float) -> dict:
    """SamplingParams keywords of the logits processing fields (f32_max: what the sampler's
    float32 penalty holds)."""
    allowed = f.get("allowed_token_ids")
    if allowed is not None:
        if not isinstance(allowed, list) or not all(_is_int(t) for t in allowed):
            raise FieldError("'allowed_token_ids' must be a list of integers", "allowed_token_ids")
        if not allowed or len(allowed) > vocab:
            raise FieldError(f"'allowed_token_ids' must hold 1 to {vocab} ids, got {len(allowed)}", "allowed_token_ids")
        if not all(0 <= t < vocab for t in allowed):
            raise FieldError(f"'allowed_token_ids' ids must be in [0, {vocab})", "allowed_token_ids")
    rep = f.float("repetition_penalty", 1.0, 0.0, f32_max, lo_open=True)
    return {"presence_penalty": f.float("presence_penalty", 0.0, -2.0, 2.0),
            "frequency_penalty": f.float("frequency_penalty", 0.0, -2.0, 2.0),
            "repetition_penalty": rep, "logit_bias": _logit_bias(f, vocab),
            "bad_words": _bad_words(f, stop_allowed), "allowed_token_ids": allowed,
            "include_stop_str_in_output": f.bool("include_stop_str_in_output")}

