"""`infc bench spec-e2e`: batch-1 decoding with speculation end to end against plain decoding, at
acceptance rates set by construction (issue 43: the machinery's cost with random weights, whose
drafts a target would reject or accept by chance).

    infc bench spec-e2e --model-path DIR --speculative-config JSON [--load-format dummy] \
        [--accept 1,0.8,0.6] [--prompt-len 32] [--max-tokens 128] [--device cuda]

At rate a, each draft row of a step is accepted with probability a, independently, up to the
first rejection: the step runs as it would (the proposer's own work, the draft model's steps, the
verify rows), and only the greedy verdict is rewritten before the speculator settles it, so the
step's cost is the real one while its tokens become the drafts (meaningless text, by design).
Expected tokens a step with k drafts: (1 - a^(k+1)) / (1 - a), k + 1 at a = 1. Reported per rate:
ms per output token after the first, tokens a step, the acceptance measured by vLLM's counters,
and the speedup over plain decoding's ms per token: an engine without speculation over the same
runner (the same kernels and weights; the two engines use its pages one request at a time), timed
before the rates and after (the mean of the two).
"""
import argparse
import json
import sys
import time
from dataclasses import replace

import numpy as np

from .common import header, save


def force_acceptance(spec, rate: float, vocab: int, rng):
    """Wrap the speculator's settle: the greedy samples of a speculating sequence's rows are made
    to accept its drafts with probability `rate` each, up to the first rejection (whose row then
    samples a token other than the draft's). Returns the wrapper's undo."""
    settle = spec.settle

    def forced(seq, samples, bm, metrics):
        draft = spec.drafts.get(seq.seq_id) or []
        a = 0
        while a < len(draft) and rng.random() < rate:
            a += 1
        samples = list(samples)
        for i in range(a):
            samples[i] = replace(samples[i], token=int(draft[i]))
        if a < len(draft) and samples[a].token == draft[a]:
            samples[a] = replace(samples[a], token=(int(draft[a]) + 1) % vocab)
        return settle(seq, samples, bm, metrics)

    spec.settle = forced
    return lambda: setattr(spec, "settle", settle)


def time_per_token(engine, prompt: list, n: int, clock=time.perf_counter) -> tuple[float, int, int]:
    """(seconds per output token after the first, output tokens, steps after the first token) of
    one greedy request alone (the prefill's step left out)."""
    from infc.runtime.engine.sampling import SamplingParams
    engine.add_request(prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), "spec-e2e")
    got, steps, t0, first = 0, 0, None, 0
    while engine.has_unfinished():
        outs = engine.step()
        for o in outs:
            got += len(o.token_ids)
        if t0 is None:
            if got:
                t0, first = clock(), got
        elif outs:
            steps += 1
    return (clock() - t0) / max(got - first, 1), got, steps


def _counters(engine) -> tuple[int, int]:
    m = engine.metrics
    return m.spec_decode_num_draft_tokens_total, m.spec_decode_num_accepted_tokens_total


def measure(llm, rates, prompt_len: int, max_tokens: int, seed: int = 0) -> dict:
    """llm: an infc.LLM with speculation; plain decoding runs on its runner in an engine of its
    own. Each run is warmed up by a short one of its own."""
    from infc.runtime.engine.engine import Engine
    plain = Engine(llm.runner, None, (), llm.max_len, max_num_seqs=8)
    vocab = llm.runner.vocab_size
    prompt = np.random.default_rng(seed).integers(0, vocab, prompt_len).tolist()
    time_per_token(plain, prompt, 8)
    base = [time_per_token(plain, prompt, max_tokens)[0]]
    k = llm.engine.spec.k
    rows = []
    for r in rates:
        undo = force_acceptance(llm.engine.spec, r, vocab, np.random.default_rng(seed + 1))
        try:
            time_per_token(llm.engine, prompt, 8)
            before = _counters(llm.engine)
            s, got, steps = time_per_token(llm.engine, prompt, max_tokens)
            after = _counters(llm.engine)
        finally:
            undo()
        drafted, accepted = after[0] - before[0], after[1] - before[1]
        expected = k + 1 if r >= 1 else (1 - r ** (k + 1)) / (1 - r)
        rows.append({"accept": r, "ms_per_token": 1e3 * s, "tokens": got,
                     "tokens_per_step": (got - 1) / steps if steps else None, "expected_tokens_per_step": expected,
                     "drafted": drafted, "accepted": accepted,
                     "acceptance": accepted / drafted if drafted else None})
    base.append(time_per_token(plain, prompt, max_tokens)[0])
    plain_ms = 1e3 * float(np.mean(base))
    for row in rows:
        row["speedup"] = plain_ms / row["ms_per_token"]
    return {"k": k, "prompt_len": prompt_len, "max_tokens": max_tokens, "plain_ms_per_token": plain_ms,
            "plain_runs_ms": [1e3 * b for b in base], "results": rows}


def _rates(text: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--accept: {text!r} is not a comma-separated list of numbers") from None
    if not vals or not all(0.0 <= v <= 1.0 for v in vals):
        raise ValueError(f"--accept: {text!r}: give rates between 0 and 1")
    return vals


def main(argv=None):
    ap = argparse.ArgumentParser(prog="infc bench spec-e2e", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--speculative-config", required=True, help="vLLM's JSON, as `infc serve` takes it")
    ap.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    ap.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when a GPU is present")
    ap.add_argument("--accept", default="1,0.8,0.6", help="acceptance rates a draft row is accepted at")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    try:
        rates = _rates(a.accept)
        spec = json.loads(a.speculative_config)
        if a.prompt_len < 1 or a.max_tokens < 2:
            raise ValueError("--prompt-len must be at least 1 and --max-tokens at least 2")
    except ValueError as e:
        sys.exit(f"infc bench spec-e2e: {e}")
    from infc import LLM
    kw = dict(device=a.device, load_format=a.load_format, max_num_seqs=8)
    try:
        with LLM(a.model_path, speculative_config=spec, **kw) as llm:
            ctx = getattr(llm.runner, "ctx", None)
            res = header(ctx if ctx is not None else "cpu", llm.runner.plan["model"])
            res.update(measure(llm, rates, a.prompt_len, a.max_tokens, a.seed))
    except (ValueError, OSError) as e:
        sys.exit(f"infc bench spec-e2e: {e}")
    res.update({"speculative_config": spec, "load_format": a.load_format})
    print(f"plain: {res['plain_ms_per_token']:.3f} ms/token")
    for r in res["results"]:
        print(f"accept {r['accept']:.2f}: {r['ms_per_token']:.3f} ms/token, {r['tokens_per_step'] or 0:.2f} tokens a "
              f"step (expected {r['expected_tokens_per_step']:.2f}), acceptance {r['acceptance'] or 0:.3f}, "
              f"{r['speedup']:.2f}x plain")
    print(f"wrote {save('spec-e2e', res, a.out)}")


if __name__ == "__main__":
    main()
