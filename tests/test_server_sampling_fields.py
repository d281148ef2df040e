"""The logits-processing fields and best_of through the server (the openai SDK; vLLM's extra
body fields): accepted on /v1/completions and /v1/chat/completions with their effect, and a 400
naming the field for each bad value. The default model's shared server (test_server_support)."""
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from test_server_support import DEFAULT, backend, per_model_srv

srv = per_model_srv([DEFAULT])
PROMPT = "The capital of France is"


def test_fields_are_accepted_and_used(srv):
    c = srv.client()
    tok = backend().tokenizer
    forced = tok.encode_text(" the")[0]
    calls = [     # at once: they share the engine's steps
        lambda: c.completions.create(model="smol", prompt=PROMPT, max_tokens=2, temperature=0,
                                     logit_bias={str(forced): 100}, presence_penalty=0.5, frequency_penalty=-0.5,
                                     extra_body={"repetition_penalty": 1.2, "ignore_eos": True}),
        lambda: c.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                          temperature=0, extra_body={"allowed_token_ids": [forced], "bad_words": ["x"],
                                                                     "include_stop_str_in_output": True}),
        lambda: c.completions.create(model="smol", prompt=PROMPT, max_tokens=2, temperature=1.0, seed=1, n=1,
                                     best_of=3)]
    with ThreadPoolExecutor(3) as pool:
        biased, chat, best = [f.result() for f in [pool.submit(fn) for fn in calls]]
    assert biased.choices[0].text == tok.decode([forced] * 2)
    assert chat.choices[0].message.content == tok.decode([forced] * 2)
    assert len(best.choices) == 1 and best.choices[0].index == 0
    assert best.usage.completion_tokens == 6                      # every candidate's tokens


@pytest.mark.parametrize("kw,param", [
    (dict(presence_penalty=-2.1), "presence_penalty"), (dict(frequency_penalty=3), "frequency_penalty"),
    (dict(extra_body={"repetition_penalty": 0}), "repetition_penalty"),
    (dict(logit_bias={"999999": 1}), "logit_bias"), (dict(logit_bias={"a": 1}), "logit_bias"),
    (dict(logit_bias={"5": "x"}), "logit_bias"), (dict(extra_body={"allowed_token_ids": []}), "allowed_token_ids"),
    (dict(extra_body={"allowed_token_ids": [10 ** 9]}), "allowed_token_ids"),
    (dict(extra_body={"bad_words": [1]}), "bad_words"), (dict(extra_body={"bad_words": [" "]}), "bad_words"),
    (dict(extra_body={"include_stop_str_in_output": "yes"}), "include_stop_str_in_output"),
    (dict(best_of=1, n=2), "best_of"), (dict(best_of=2, stream=True), "best_of"), (dict(best_of=500), "best_of"),
])
def test_bad_values_are_400_naming_the_field(srv, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        srv.client().completions.create(model="smol", prompt="hi", **{"max_tokens": 2, **kw})
    assert e.value.status_code == 400 and e.value.param == param, e.value.body
