"""Self-draft on the GPU: acceptance of greedy rows and of sampled rows apart, with the plain
outputs compared per request (which rows diverge, and where)."""
import sys
sys.path.insert(0, "tests/gpu")
from test_spec_gpu import config_dir, draft_config, draft_prompts, decode_all, acceptance, DRAFT_TARGET
from infc import LLM
from infc.runtime.engine.sampling import SamplingParams

if __name__ == "__main__":
    d = config_dir(DRAFT_TARGET)
    kw = dict(device="cuda", load_format="dummy", max_num_seqs=8, gpu_memory_utilization=0.5)
    sets = {"greedy": [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)],
            "sampled": [SamplingParams(max_tokens=32, temperature=0.8, top_p=0.9, top_k=50, seed=11, ignore_eos=True)],
            "sampled-lp": [SamplingParams(max_tokens=32, temperature=0.8, top_p=0.9, top_k=50, seed=11, ignore_eos=True, logprobs=1)]}
    with LLM(d, **kw) as llm:
        prompts = draft_prompts(llm.runner.vocab_size)
        plain = {n: decode_all(llm.engine, prompts, p) for n, p in sets.items()}
    with LLM(d, speculative_config=draft_config(d, 4), **kw) as llm:
        print("target artifact", llm.runner.artifact.name, "draft", llm.engine.spec.draft.runner.artifact.name)
        for n, p in sets.items():
            m = llm.engine.metrics
            a0, d0 = m.spec_decode_num_accepted_tokens_total, m.spec_decode_num_draft_tokens_total
            got = decode_all(llm.engine, prompts, p)
            a1, d1 = m.spec_decode_num_accepted_tokens_total, m.spec_decode_num_draft_tokens_total
            div = {r: next((i for i, (x, y) in enumerate(zip(got[r], plain[n][r])) if x != y), None) for r in got}
            print(f"{n}: acceptance {(a1 - a0) / max(d1 - d0, 1):.3f} ({a1 - a0} of {d1 - d0}); first divergence per request {div}")
