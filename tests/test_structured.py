"""Structured outputs without a model: the bitmasks against llguidance's own check of every
token, the masked numpy sampler, the errors a bad request gets (naming its field), the compile
time limit and cache, and where a reasoning section ends."""
import asyncio
import json
import time

import numpy as np
import pytest

from infc.runtime.engine.async_engine import AsyncEngine
from infc.runtime.engine.logits_process import unpack_bitmask as allowed
from infc.runtime.engine.runner import RowSampling, sample_row
from infc.runtime.engine.sampling import SamplingParams, logprobs_of
from infc.runtime.engine.structured import cache as cache_mod
from infc.runtime.engine.structured.cache import GrammarCache
from infc.runtime.engine.structured.request import StructuredOutputError, StructuredOutputs
from grammar_fixtures import EOS, LogitsRunner, small_tokenizer
from test_scheduler import make_engine

V = 320                               # the model's vocabulary: past the tokenizer's ~300 ids (padding)
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
          "required": ["name", "age"], "additionalProperties": False}
KINDS = {"json": StructuredOutputs(json=json.dumps(SCHEMA)),
         "json_object": StructuredOutputs(json_object=True),
         "regex": StructuredOutputs(regex=r"[0-9]{3}-[a-z]{2,4}"),
         "choice": StructuredOutputs(choice=("yes", "no", "maybe")),
         "lark": StructuredOutputs(grammar='start: "[" item ("," item)* "]"\nitem: /[0-9]/ | "true"'),
         "gbnf": StructuredOutputs(grammar='root ::= "hello" ws ("world" | "there")\nws ::= " "?')}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return small_tokenizer(tmp_path_factory.mktemp("small-tokenizer"))


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return GrammarCache(tokenizer, [EOS], V)


@pytest.mark.parametrize("kind", list(KINDS))
def test_bitmask_is_llguidance_check_of_every_token(grammars, kind):
    """At each state along a random walk, bit v is set only where the matcher itself accepts
    token v, and exactly there where the grammar forces no bytes (with bytes forced, llguidance
    allows their canonical tokens only: '{"' but not '{'); the model's padded ids are never
    allowed."""
    g = grammars.grammar(KINDS[kind])
    rng = np.random.default_rng(len(kind))
    tok_vocab = grammars.tokenizer.vocab_size
    for _ in range(40):
        mask = allowed(grammars.masks([g])[0], V)
        want = np.array([t < tok_vocab and g.matcher.validate_tokens([t]) == 1 for t in range(V)])
        want[EOS] = g.matcher.is_accepting()          # EOS: allowed where the output is complete
        assert not (mask & ~want).any(), np.flatnonzero(mask & ~want)
        if not g.matcher.compute_ff_bytes():
            assert (mask == want).all(), np.flatnonzero(mask != want)
        assert mask.any() and not mask[tok_vocab:].any()
        if g.finished:
            break
        choices = np.flatnonzero(mask)
        tok = int(rng.choice(choices[choices != EOS] if (choices != EOS).any() else choices))
        g.accept(tok)


def test_masked_sampler_never_emits_a_disallowed_token():
    rng = np.random.default_rng(0)
    for i in range(300):
        logits = (rng.standard_normal(V) * 4).astype(np.float32)
        keep = rng.random(V) < rng.choice([0.003, 0.05, 0.5])
        keep[int(np.argsort(logits)[rng.integers(V)])] = True
        logits[~keep] += 10                                    # the disallowed tokens are the likeliest
        mask = np.packbits(np.concatenate([keep, np.zeros(-V % 32, bool)]), bitorder="little").view("<i4")
        p = SamplingParams(temperature=[0, 0.7, 1.5][i % 3], top_k=[0, 5][i % 2], top_p=[1, 0.9][i % 2],
                           logprobs=2)
        s = sample_row(logits, RowSampling(p, seed=i, step=i, bitmask=mask))
        assert keep[s.token], (i, s.token)
        assert s.logprob == pytest.approx(logprobs_of(logits)[s.token])     # the model's distribution
    assert (allowed(mask, V) == keep).all()


def test_bad_requests_name_their_field(grammars):
    cases = {
        "not valid JSON": StructuredOutputs(json="{nope", field="response_format.json_schema"),
        "Invalid type": StructuredOutputs(json='{"type": "objekt"}', field="response_format"),
        "Unimplemented keys": StructuredOutputs(json='{"type": "object", "if": {}}', field="response_format"),
        "regex": StructuredOutputs(regex="[a-z", field="guided_regex"),
        "unknown name": StructuredOutputs(grammar='start: "a" | b', field="guided_grammar"),
        "non-empty list": StructuredOutputs(choice=(), field="guided_choice"),
        "exactly one": StructuredOutputs(regex="a", choice=("a",), field="structured_outputs"),
        "list of strings": StructuredOutputs(choice=("a", 1), field="guided_choice"),
        "json must be a string": StructuredOutputs(json={"type": "object"}, field="response_format"),
        "regex parse error": StructuredOutputs(json='{"type": "string", "pattern": "(("}', field="x"),
    }
    for words, so in cases.items():
        with pytest.raises(StructuredOutputError, match=words) as e:
            grammars.check(so)
        assert e.value.field == so.field
    grammars.check(StructuredOutputs(choice=["a", "b"]))      # a list serves (made hashable)
    # not strict: keywords llguidance does not implement are ignored, not refused
    grammars.check(StructuredOutputs(json='{"type": "object", "if": {}}', strict=False))
    with pytest.raises(StructuredOutputError, match="need a tokenizer"):
        GrammarCache(None, [EOS]).check(KINDS["regex"])

    class Unreadable:                         # a tokenizer the library cannot load: a 400, no 500
        vocab_size = 10
        tk = type("tk", (), {"to_str": staticmethod(lambda: "{not a tokenizer")})
    with pytest.raises(StructuredOutputError, match="not available for this model's tokenizer") as e:
        GrammarCache(Unreadable(), [EOS]).check(StructuredOutputs(regex="a", field="guided_regex"))
    assert e.value.field == "guided_regex"


def test_engine_refuses_a_bad_grammar_at_its_door(tokenizer):
    e = make_engine(LogitsRunner(32, vocab_size=V), tokenizer=tokenizer, eos_ids=[EOS])
    bad = SamplingParams(structured_outputs=StructuredOutputs(regex="(", field="guided_regex"))
    for door in (lambda: e.add_request([5, 6], bad), lambda: e.check_request([5, 6], bad)):
        with pytest.raises(StructuredOutputError) as err:
            door()
        assert err.value.field == "guided_regex"
    assert not e.has_unfinished()


def test_a_slow_compile_is_refused_in_time_and_cached_once_done(tokenizer):
    """A schema that compiles in tens of ms against a 1 ms limit: refused with the limit named;
    its compile goes on in its worker, and the same schema later finds it compiled (one compile)."""
    props = {f"p{i}": {"type": "string", "pattern": "[a-z]{1,%d}" % (i % 7 + 1)} for i in range(800)}
    so = StructuredOutputs(json=json.dumps({"type": "object", "properties": props}), field="response_format")
    cache = GrammarCache(tokenizer, [EOS], V, timeout_s=0.001)
    cache.llg()
    with pytest.raises(StructuredOutputError, match="took longer than 0.001 s to compile") as e:
        cache.check(so)
    assert e.value.field == "response_format"
    cache.timeout_s = 30
    cache.check(so)
    cache.check(StructuredOutputs(json=so.json, field="response_format", start_after=(7,)))
    assert len(cache._entries) == 1


def test_check_structured_runs_off_the_event_loop(tokenizer, monkeypatch):
    """The server's door: a compile slower than the limit is a StructuredOutputError while the
    event loop goes on serving (it ticks throughout)."""
    compile_grammar = cache_mod.compile_grammar

    def slow(so, llg):
        time.sleep(0.6)
        return compile_grammar(so, llg)
    monkeypatch.setattr(cache_mod, "compile_grammar", slow)
    e = make_engine(LogitsRunner(32, vocab_size=V), tokenizer=tokenizer, eos_ids=[EOS])
    e.grammars.timeout_s = 0.3
    engine = AsyncEngine(e)

    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1
        t = asyncio.create_task(ticker())
        with pytest.raises(StructuredOutputError, match="took longer than 0.3 s") as err:
            await engine.check_structured(StructuredOutputs(regex="[0-9]+", field="guided_regex"))
        t.cancel()
        return ticks, err.value.field
    try:
        ticks, field = asyncio.run(main())
    finally:
        engine.shutdown()
    assert field == "guided_regex" and ticks >= 10


def test_the_grammar_applies_after_the_reasoning_section(grammars, tokenizer):
    end = tuple(tokenizer.encode_text("</think>"))
    g = grammars.grammar(StructuredOutputs(choice=("yes", "no"), start_after=end))
    for t in tokenizer.encode_text("hmm </thi") + tokenizer.encode_text("k"):
        g.accept(t)                                  # anything goes while the section is open
    assert not g.active
    for t in end:
        g.accept(t)
    assert g.active and not g.finished
    allowed_text = {tokenizer.decode([t]) for t in np.flatnonzero(allowed(grammars.masks([g])[0], V))}
    assert allowed_text and allowed_text <= {"y", "n", "ye", "yes", "no"}
    for t in tokenizer.encode_text("yes"):
        g.accept(t)
    assert g.finished
