"""n-gram speculative decoding on the real SmolLM2-135M (numpy reference): on copy-heavy prompts
(bench/speculative.py's 20: edit this text, quote in a summary, refactor code) the greedy text is
token for token plain decoding's, with most drafts accepted. The fast suite runs two prompts
batched together; --exhaustive all twenty. The acceptance rate and CPU speedup alone at batch 1:
`python -m infc.bench.speculative`."""
import pytest

from exhaustive import EXHAUSTIVE
from infc import LLM, SamplingParams
from infc.bench.speculative import PROMPTS

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5,
        "disable_by_batch_size": 64}


@pytest.fixture(scope="module")
def pair():
    from smollm2_from_gguf import ensure_smollm2
    d = ensure_smollm2()
    from threadpoolctl import threadpool_limits
    with threadpool_limits(1, user_api="blas"), LLM(d, device="cpu") as plain, \
            LLM(d, device="cpu", speculative_config=SPEC) as spec:
        yield plain, spec


@pytest.mark.parametrize("prompts,n", [((1, 13), 16), pytest.param(range(len(PROMPTS)), 48, marks=EXHAUSTIVE)],
                         ids=["two", "all"])
def test_greedy_text_identical_and_drafts_accepted(pair, prompts, n):
    plain, spec = pair
    texts = [PROMPTS[i] for i in prompts]
    params = SamplingParams(max_tokens=n, temperature=0)
    want = plain.generate(texts, params)
    m = spec.engine.metrics
    before = (m.spec_decode_num_draft_tokens_total, m.spec_decode_num_accepted_tokens_total)
    got = spec.generate(texts, params)
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids and g.text == w.text, g.prompt
    drafted = m.spec_decode_num_draft_tokens_total - before[0]
    accepted = m.spec_decode_num_accepted_tokens_total - before[1]
    assert accepted > 0.5 * drafted > 0          # copy-heavy prompts: most drafts are right
