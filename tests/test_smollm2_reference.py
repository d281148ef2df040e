"""The real SmolLM2-135M through infc's plan and numpy reference executor: it knows Paris,
and its greedy tokens equal transformers' on three prompts."""
import pytest
import torch

from exhaustive import EXHAUSTIVE

from infc import LLM, SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


@pytest.fixture(scope="module")
def smollm2():
    from smollm2_from_gguf import ensure_smollm2
    return ensure_smollm2()


@pytest.fixture(scope="module")
def llm(smollm2):
    return LLM(smollm2, device="cpu")


def test_paris(llm):
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=8, temperature=0))[0]
    assert "Paris" in out.text


# 16 tokens in the fast suite, 32 with --exhaustive
@pytest.mark.parametrize("n", [16, pytest.param(32, marks=EXHAUSTIVE)])
def test_greedy_tokens_match_transformers(llm, smollm2, n):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(smollm2)
    hf = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    # min_tokens masks EOS exactly as HF min_new_tokens does
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=n, min_tokens=n, temperature=0))
    for prompt, out in zip(PROMPTS, outs):
        ids = tok(prompt, return_tensors="pt").input_ids
        assert out.prompt_token_ids == ids[0].tolist()
        with torch.no_grad():
            want = hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                               pad_token_id=tok.eos_token_id)[0, ids.shape[1]:].tolist()
        assert out.token_ids == want, prompt
        assert out.text == tok.decode(want, skip_special_tokens=True)
