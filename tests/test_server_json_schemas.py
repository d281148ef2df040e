"""The 60 JSON schemas of tests/data/json_schemas/schemas.json through `infc serve` (the real
SmolLM2-135M on the CPU): each level's 15 schemas, greedy and sampled, sent at once over
/v1/completions with vLLM's `structured_outputs` field; every completion validates against its
schema (the `jsonschema` package) and ends with "stop". Batched, the 120 requests take ~45 CPU-s
on the 2-core machine: in the fast suite (issue 41's acceptance: in CI, through `infc serve`)."""
import json

import jsonschema
import pytest

from test_server_support import NAMES, live, one_blas_thread, run_together, use_model  # noqa: F401
from test_structured_smollm2 import SCHEMAS


@pytest.fixture(scope="module")
def srv():
    use_model(None)
    return live()


@pytest.mark.slow
@pytest.mark.parametrize("level", [1, 2, 3, 4], ids=lambda v: f"level{v}")
def test_all_60_schemas_through_the_server(srv, level):
    c = srv.client()
    calls, want = [], []
    for s in (s for s in SCHEMAS if s["level"] == level):
        for mode, kw in (("greedy", dict(temperature=0.0)), ("sampled", dict(temperature=0.8, seed=len(s["name"])))):
            calls.append(lambda s=s, kw=kw: c.completions.create(
                model=NAMES[0], prompt=s["prompt"], max_tokens=96,
                extra_body={"structured_outputs": {"json": s["schema"]}}, **kw))
            want.append((f"{s['name']}/{mode}", s["schema"]))
    for (rid, schema), r in zip(want, run_together(calls)):
        choice = r.choices[0]
        assert choice.finish_reason == "stop", (rid, choice.text)
        jsonschema.validate(json.loads(choice.text), schema)
