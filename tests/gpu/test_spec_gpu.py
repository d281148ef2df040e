"""n-gram speculative decoding over the CUDA runner (issue 43): verify steps are decode steps
whose rows are the draft positions, so they run the decode programs and CUDA graphs; the outputs
must be those of plain decoding, greedy and seeded sampled, with drafts accepted, and no page
held after aborts mid-speculation. llama-3.2-1b shapes with random weights: its greedy output
falls into loops that prompt lookup then drafts from (self-repeating prompts start them)."""
import numpy as np

from infc.config import speculative_config
from infc.runtime.engine.engine import Engine
from infc.runtime.engine.sampling import SamplingParams

MODEL = "llama-3.2-1b"
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def _prompts(vocab: int, n: int, rng) -> list:
    out = []
    for _ in range(n):
        motif = rng.integers(0, vocab, int(rng.integers(3, 9))).tolist()
        out.append((motif * 8)[: int(rng.integers(20, 60))])
    return out


def _run(engine, prompts, params, abort_every=0) -> dict:
    for i, p in enumerate(prompts):
        engine.add_request(p, params[i % len(params)], f"r{i}")
    out, steps = {}, 0
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.token_ids)
        steps += 1
        if abort_every and steps % abort_every == 0:
            live = [r for r in engine.requests]
            if live:
                engine.abort(live[0])
    return out


def test_speculative_outputs_are_plain_decodings(model_dir, artifact):
    from infc.runtime.cuda.runner import CudaRunner       # tests/test_spec_gpu_logic.py imports this file
    runner = CudaRunner(artifact(MODEL), model_dir(MODEL), max_num_batched_tokens=2048, max_num_seqs=32,
                        num_pages=512, buckets=[1, 2, 4, 8, 16, 24, 32])
    try:
        rng = np.random.default_rng(43)
        prompts = _prompts(runner.vocab_size, 12, rng)
        params = [SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True),
                  SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, top_k=50, seed=7, ignore_eos=True,
                                 logprobs=2)]
        plain = _run(Engine(runner, None, (), 2048, max_num_seqs=32), prompts, params)
        spec = Engine(runner, None, (), 2048, max_num_seqs=32, speculative_config=speculative_config(SPEC))
        got = _run(spec, prompts, params)
        m = spec.metrics
        print(f"drafts {m.spec_decode_num_drafts_total}, draft tokens {m.spec_decode_num_draft_tokens_total}, "
              f"accepted {m.spec_decode_num_accepted_tokens_total}")
        assert got == plain
        assert m.spec_decode_num_accepted_tokens_total > 0
        # aborts mid-speculation: every page back
        e = Engine(runner, None, (), 2048, max_num_seqs=32, speculative_config=speculative_config(SPEC))
        free = e.bm.num_free_pages
        _run(e, _prompts(runner.vocab_size, 40, rng), params[:1], abort_every=3)
        assert e.bm.num_free_pages == free
        e.bm.check()
    finally:
        runner.close()
