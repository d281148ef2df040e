"""Structured outputs on the real SmolLM2-135M (CPU reference engine), batched in one engine run
each: every output validates against its JSON schema (the `jsonschema` package), matches its regex
or choice, and ends with "stop". The fast suite runs three schemas of tests/data/json_schemas/
schemas.json (nesting, anyOf, a bounded array and integer ranges between them)
beside a regex and a choice with n > 1; all 60 schemas of graded difficulty (nested objects,
bounded arrays, enums, anyOf/oneOf, patterns, formats, number ranges, optional fields, $refs),
greedy and sampled, run behind the exhaustive marker (the server-level test reuses the file)."""
import json
import re
from pathlib import Path

import jsonschema
import pytest

from infc.llm import LLM
from infc.runtime.engine.sampling import SamplingParams
from infc.runtime.engine.structured.request import StructuredOutputs
from exhaustive import EXHAUSTIVE

SCHEMAS = json.loads((Path(__file__).parent / "data" / "json_schemas" / "schemas.json").read_text())
FAST = ["deep_nest", "anyof_objects", "scores"]    # nesting, anyOf + const, a bounded array, ranges
REGEX = r"[0-9]{3}-[a-z]{2,5}"
CHOICE = ("red", "green", "blue")


@pytest.fixture(scope="module")
def llm():
    from smollm2_from_gguf import ensure_smollm2
    return LLM(ensure_smollm2(), device="cpu", max_num_seqs=128)


def schema_requests(names, modes=("greedy", "sampled")) -> list:
    """(request id, prompt, params, check) for each schema, greedy and / or sampled."""
    by_name = {s["name"]: s for s in SCHEMAS}
    out = []
    for name in names:
        s = by_name[name]
        so = StructuredOutputs(json=json.dumps(s["schema"]), field="response_format")
        for mode, kw in (("greedy", dict(temperature=0.0)), ("sampled", dict(temperature=0.8, seed=len(name)))):
            if mode not in modes:
                continue
            out.append((f"{name}/{mode}", s["prompt"], SamplingParams(max_tokens=96, structured_outputs=so, **kw),
                        lambda text, schema=s["schema"]: jsonschema.validate(json.loads(text), schema)))
    return out


def run_batch(llm, requests) -> dict:
    """Every request added to one engine, stepped until all are done: id -> [(text, reason)]."""
    e = llm.engine
    for rid, prompt, params, _ in requests:
        e.add_request(llm.tokenizer.encode(prompt), params, rid)
    outs = {}
    while e.has_unfinished():
        for o in e.step():
            assert o.error is None, o.error
            texts = outs.setdefault(o.request_id, {})
            text, _ = texts.get(o.index, ("", None))
            texts[o.index] = (text + o.text, o.finish_reason)
    return {rid: [outs[rid][i] for i in sorted(outs[rid])] for rid in outs}


def check_all(requests, outs):
    for rid, _, params, check in requests:
        assert len(outs[rid]) == params.n
        for text, reason in outs[rid]:
            assert reason == "stop", (rid, text, reason)
            check(text)


@pytest.mark.slow
def test_schemas_regex_choice_and_n_in_one_batch(llm):
    requests = schema_requests(FAST, modes=("greedy",)) + [
        ("regex", "Give a code:", SamplingParams(max_tokens=20, temperature=0.0,
                                                 structured_outputs=StructuredOutputs(regex=REGEX)),
         lambda text: re.fullmatch(REGEX, text) or pytest.fail(text)),
        ("choice-n2", "My favourite color is", SamplingParams(
            max_tokens=8, temperature=1.0, seed=5, n=2, structured_outputs=StructuredOutputs(choice=CHOICE)),
         lambda text: text in CHOICE or pytest.fail(text))]
    check_all(requests, run_batch(llm, requests))


@EXHAUSTIVE
@pytest.mark.slow
@pytest.mark.parametrize("level", [1, 2, 3, 4], ids=lambda v: f"level{v}")
def test_all_60_schemas_greedy_and_sampled(llm, level):
    """15 schemas a level, 30 sequences in one batch (measured on the 2-core CPU machine, under
    other load: ~4 min for 60 sequences of one mode)."""
    requests = schema_requests([s["name"] for s in SCHEMAS if s["level"] == level])
    check_all(requests, run_batch(llm, requests))


def test_the_schema_file_holds_60_valid_schemas_of_four_levels():
    assert len(SCHEMAS) == 60 and len({s["name"] for s in SCHEMAS}) == 60
    assert sorted({s["level"] for s in SCHEMAS}) == [1, 2, 3, 4]
    for s in SCHEMAS:
        jsonschema.Draft202012Validator.check_schema(s["schema"])
        assert s["prompt"]
