"""Prompt logprobs (echo with logprobs) through the engine's public door, on any backend.

The engine samples only at the end of a chunk and has no prompt-logprobs path: its plans emit
logits for the last row of each sequence, not for every prompt position. So the logprob of
prompt token i is asked for the way the engine can answer it: a one-token request whose prompt
is ids[:i], greedy, with every token but ids[i] banned (stop_token_ids, which the engine bans
until min_tokens = 1 is reached). The runner reports logprobs from the unmasked logits, so the
forced token's logprob and the top alternatives are exactly the model's.

Cost: the request for the whole prompt (ids[:-1]) runs first, and its full KV blocks enter the
prefix cache; the others then reuse them and compute at most one page each (at most 16 tokens),
`WINDOW` at a time. With --no-enable-prefix-caching each recomputes its prefix (quadratic).
These internal requests show in the engine's metrics (request and token counters).

What would replace this: SamplingParams.prompt_logprobs in the engine, with the runner
returning logits for every prompt row of a chunk (the plan's lm_head over all rows, not only the
last), so one prefill answers every position.
"""
import asyncio

from infc.runtime.engine.sampling import SamplingParams

WINDOW = 32


class _AllBut:
    """The vocabulary without one id, as the list stop_token_ids wants (shares one range list)."""

    def __init__(self, vocab_size: int):
        self.ids = list(range(vocab_size))

    def __call__(self, keep: int) -> list[int]:
        return self.ids[:keep] + self.ids[keep + 1:]


_cache: dict[int, _AllBut] = {}


def requests_for(n_tokens: int) -> int:
    """Engine requests that scoring a prompt of n_tokens causes (admission.cost counts them)."""
    return max(0, n_tokens - 1)


def _all_but(vocab_size: int, keep: int) -> list[int]:
    if vocab_size not in _cache:
        _cache[vocab_size] = _AllBut(vocab_size)
    return _cache[vocab_size](keep)


async def prompt_logprobs(engine, ids: list[int], top: int, vocab_size: int, request_id: str) -> list:
    """[None, {"token", "logprob", "top": [(id, logprob)]}, ...]: one entry per prompt token (the
    first has no context, hence None)."""
    result: list = [None] * len(ids)

    async def score(i: int):
        params = SamplingParams(max_tokens=1, min_tokens=1, temperature=0.0, ignore_eos=True,
                                stop_token_ids=_all_but(vocab_size, ids[i]), logprobs=top,
                                skip_special_tokens=False)
        # a prefix of a prompt the server checked, with max_tokens 1: it fits where the prompt did
        async for out in engine.generate(ids[:i], params, f"{request_id}-score-{i}", checked=True):
            if out.token_ids and out.logprobs:
                lp = out.logprobs[0]
                if out.token_ids[0] != ids[i]:       # the ban did not hold: a bug, say so
                    raise RuntimeError(f"prompt scoring forced token {ids[i]} but got {out.token_ids[0]}")
                result[i] = {"token": ids[i], "logprob": lp["logprob"], "top": lp["top"] or []}

    if len(ids) < 2:
        return result
    await score(len(ids) - 1)              # caches the prompt's full blocks for the others
    sem = asyncio.Semaphore(WINDOW)

    async def windowed(i):
        async with sem:
            await score(i)

    async with asyncio.TaskGroup() as tg:  # one failure (or a cancel) cancels the rest
        for i in range(1, len(ids) - 1):
            tg.create_task(windowed(i))
    return result
