"""Each logits-processing field's effect on the real SmolLM2-135M on the CPU engine, in one
batched engine run: a huge logit_bias forces its token, allowed_token_ids restricts, bad words
never appear, the penalties change greedy output, include_stop_str_in_output keeps the stop
string; best_of returns the n likeliest of its candidates."""
import numpy as np
import pytest

from infc import LLM, SamplingParams

PARIS = "The capital of France is"
STORY = "Once upon a time, there was a little"
MAX = 4
BEST_OF = dict(max_tokens=3, temperature=1.0, seed=5, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    from smollm2_from_gguf import ensure_smollm2
    return LLM(ensure_smollm2(), device="cpu")


def greedy(**kw):
    return SamplingParams(max_tokens=MAX, temperature=0, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def outs(llm):
    tok = llm.tokenizer
    word = tok.encode_text(" the")
    allowed = sorted(set(tok.encode_text(" Paris London Rome.")))
    reqs = {
        "paris": (PARIS, greedy()),
        "bias": (PARIS, greedy(logit_bias={word[0]: 100.0})),
        "allowed": (PARIS, greedy(allowed_token_ids=allowed)),
        "bad": (PARIS, greedy(bad_words=["Paris", "the"])),
        "rep": (PARIS, greedy(repetition_penalty=1.5)),
        "freq_pres": (PARIS, greedy(frequency_penalty=2.0, presence_penalty=2.0)),
        "candidates": (STORY, SamplingParams(n=4, logprobs=0, **BEST_OF)),
        "stop": (PARIS, SamplingParams(max_tokens=MAX, temperature=0, stop=["."])),
        "stop_kept": (PARIS, SamplingParams(max_tokens=MAX, temperature=0, stop=["."], include_stop_str_in_output=True)),
    }
    e = llm.engine
    for rid, (prompt, p) in reqs.items():
        e.add_request(tok.encode(prompt), p, rid)
    got = {(rid, i): {"ids": [], "text": "", "lp": []} for rid, (_, p) in reqs.items() for i in range(p.n)}
    while e.has_unfinished():
        for o in e.step():
            assert o.error is None, o.error
            c = got[(o.request_id, o.index)]
            c["ids"] += o.token_ids
            c["text"] += o.text
            c["lp"] += [x["logprob"] for x in o.logprobs or ()]
    got.update({rid: got[(rid, 0)] for rid in reqs})
    return got, word, allowed


def test_logit_bias_forces_and_allowed_restricts(outs):
    got, word, allowed = outs
    assert got["bias"]["ids"] == [word[0]] * MAX
    assert set(got["allowed"]["ids"]) <= set(allowed) and len(got["allowed"]["ids"]) == MAX


def test_bad_words_never_appear(outs):
    got, _, _ = outs
    assert "Paris" in got["paris"]["text"]
    assert "Paris" not in got["bad"]["text"] and " the" not in got["bad"]["text"]


def test_penalties_change_greedy_output(outs):
    got, _, _ = outs
    base = got["paris"]["ids"]
    assert base[:3] == got["rep"]["ids"][:3] and got["rep"]["ids"] != base
    assert base[:3] == got["freq_pres"]["ids"][:3] and got["freq_pres"]["ids"] != base
    assert base[3] == base[2]                     # plain greedy repeats "\n": the penalties do not


def test_include_stop_str_in_output(outs):
    got, _, _ = outs
    assert got["stop"]["text"] == " Paris"
    assert got["stop_kept"]["text"] == " Paris."


def test_best_of_returns_the_likeliest_n(llm, outs):
    every = [outs[0][("candidates", i)] for i in range(4)]        # the same seeds: the candidates
    best = llm.generate(STORY, SamplingParams(n=2, best_of=4, **BEST_OF))[0].outputs
    order = np.argsort([-sum(c["lp"]) for c in every], kind="stable")[:2]
    assert [c.token_ids for c in best] == [every[i]["ids"] for i in order]
    assert [c.index for c in best] == [0, 1] and all(c.logprobs is None for c in best)
    assert len({tuple(c["ids"]) for c in every}) > 2             # the candidates differ
