"""Prompt logprobs' reference for the tests (CPU, fake device and GPU): the old path, one forced-token
request per prompt position, and the engine's own prompt_logprobs, in one engine run each."""
import numpy as np

from infc.runtime.engine.sampling import SamplingParams


def forced_reference(engine, prompts: list[list[int]], k: int) -> list[list]:
    """The old path, all positions of all prompts in one engine run: entry i of prompt p is the
    logprob of p[i] after p[:i] and the top k, as a forced-token one-token request reports it."""
    V = engine.runner.vocab_size
    for p, ids in enumerate(prompts):
        for i in range(1, len(ids)):
            ban = [t for t in range(V) if t != ids[i]]
            engine.add_request(ids[:i], SamplingParams(max_tokens=1, min_tokens=1, temperature=0,
                                                       ignore_eos=True, stop_token_ids=ban,
                                                       logprobs=k), f"{p}-{i}")
    got = {}
    while engine.has_unfinished():
        for o in engine.step():
            assert o.error is None, o.error
            if o.token_ids:
                got[o.request_id] = o.token_ids[0], o.logprobs[0]
    out = []
    for p, ids in enumerate(prompts):
        row = [None]
        for i in range(1, len(ids)):
            tok, lp = got[f"{p}-{i}"]
            assert tok == ids[i]
            row.append(lp)
        out.append(row)
    return out


def engine_scores(engine, prompts, k: int, n: int = 1) -> tuple[list[list], dict]:
    """Prompt logprobs of each prompt from the engine's one request each (and its outputs)."""
    for p, ids in enumerate(prompts):
        engine.add_request(ids, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, n=n,
                                               prompt_logprobs=k), f"p{p}")
    scores, outs = {}, {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault((o.request_id, o.index), []).extend(o.token_ids)
            if o.prompt_logprobs is not None:
                assert o.request_id not in scores, "prompt logprobs come once a request"
                scores[o.request_id] = o.prompt_logprobs
    return [scores[f"p{p}"] for p in range(len(prompts))], outs


def assert_same(got: list, want: list, tol: float, exact_order: bool = True):
    """Entries equal within tol. exact_order=False (bf16 GPU kernels, rows batched otherwise):
    the top ids may swap where their logprobs are within tol of each other."""
    assert len(got) == len(want) and got[0] is None
    for i, (g, w) in enumerate(zip(got[1:], want[1:]), 1):
        assert g["token"] == w["token"], i
        assert abs(g["logprob"] - w["logprob"]) < tol, (i, g["logprob"], w["logprob"])
        assert np.allclose([x for _, x in g["top"]], [x for _, x in w["top"]], atol=tol), i
        if exact_order:
            assert [t for t, _ in g["top"]] == [t for t, _ in w["top"]], i
        else:
            near = {t for t, x in w["top"] if min(abs(x - y) for u, y in w["top"] if u != t) < tol}
            assert {t for t, _ in g["top"]} - near == {t for t, _ in w["top"]} - near, i
        assert g["rank"] == 1 + sum(x > g["logprob"] + tol for _, x in g["top"]) or g["rank"] > len(g["top"])
