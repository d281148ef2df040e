"""best_of: draw best_of completions, hand back the n with the highest cumulative logprob.

As vLLM's V0 engine and OpenAI's legacy completions: the candidates are ordinary sampled
completions (seeds seed, seed + 1, ... as for n), ranked by the sum of their tokens' logprobs
(of the model's distribution, the logprobs clients see); usage counts every token generated.
The engine draws the candidates (n = best_of, each token's logprob asked for); the caller
(infc.LLM, the server) ranks them.
"""
from dataclasses import replace

from .sampling import SamplingParams


def wants_best_of(p: SamplingParams) -> bool:
    return p.best_of is not None and p.best_of > p.n


def candidates(p: SamplingParams) -> SamplingParams:
    """The engine's parameters for p's candidates."""
    if not wants_best_of(p):
        return p
    return replace(p, n=p.best_of, best_of=None, logprobs=0 if p.logprobs is None else p.logprobs)


def cumulative_logprob(entries) -> float:
    return sum(e["logprob"] for e in entries or ())


def choose(completions: list, n: int, logprobs_of) -> list:
    """The n completions with the highest cumulative logprob, best first (stable: ties keep the
    lower index). logprobs_of(c): c's logprob entries ({"logprob": ...} a token)."""
    ranked = sorted(range(len(completions)), key=lambda i: -cumulative_logprob(logprobs_of(completions[i])))
    return [completions[i] for i in ranked[:n]]
