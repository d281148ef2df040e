"""Prompt logprobs for the server: echo with logprobs on /v1/completions, and vLLM's
`prompt_logprobs` on completions and chat.

Where the engine scores prompt rows (Engine.scores_prompts: a runner with row logits, the CPU
runner and the one-process CUDA runner), a request's prompt logprobs come from the one prefill that reads its prompt: its
engine requests carry SamplingParams.prompt_logprobs (the largest k any view asks for), and the
first output of each prompt brings them. Echo with max_tokens 0 asks one token, dropped (vLLM
does the same). So a scoring request is the client's request and nothing more: one engine
request a prompt in the admission cost and in /metrics.

Elsewhere (rank processes, data-parallel ranks: no row logits yet) echo with logprobs keeps the
old path:
each prompt token asked of its own one-token request (prompt ids[:i], greedy, every token but
ids[i] banned through stop_token_ids until min_tokens = 1), the prompt's full blocks cached
first so the others compute at most a page each, WINDOW at a time. Those internal requests show
in no metrics (counted=False); `prompt_logprobs` itself is refused there (the engine's check).
"""
import asyncio
import dataclasses

from infc.runtime.engine.sampling import SamplingParams

WINDOW = 32


def asked(req) -> int | None:
    """The prompt logprobs' k the request needs: the larger of echo's logprobs and
    prompt_logprobs; None when it needs none."""
    ks = [k for k in (req.logprobs if req.echo else None, req.prompt_logprobs) if k is not None]
    return max(ks) if ks else None


def in_engine(engine, req) -> bool:
    """Whether the request's prompt logprobs come from its own prefill (else the forced-token path)."""
    return asked(req) is not None and bool(getattr(engine, "scores_prompts", False))


def engine_params(engine, req) -> SamplingParams | None:
    """The SamplingParams of each engine request of this request (None: it needs none): the
    parsed ones, with prompt_logprobs where they are asked of the engine; one dropped token
    where nothing is to be generated (echo with max_tokens 0)."""
    k = asked(req)
    if k is None or (req.prompt_logprobs is None and not in_engine(engine, req)):
        return req.params                  # nothing to score, or echo on the forced-token path
    # (prompt_logprobs where the engine cannot score: its check refuses the request, and says why)
    base = req.params or SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    return dataclasses.replace(base, prompt_logprobs=k)


def requests_for(engine, req, n_tokens: int) -> int:
    """Engine requests besides the request's own that scoring a prompt of n_tokens causes
    (admission.cost counts them): none where the engine scores prompts."""
    if asked(req) is None or in_engine(engine, req):
        return 0
    return max(0, n_tokens - 1)


def with_top(entry: dict | None, k: int) -> dict | None:
    """An engine entry cut to k alternatives (the engine computed the largest k any view asked)."""
    return None if entry is None else {**entry, "top": entry["top"][:k]}


class _AllBut:
    """The vocabulary without one id, as the list stop_token_ids wants (shares one range list)."""

    def __init__(self, vocab_size: int):
        self.ids = list(range(vocab_size))

    def __call__(self, keep: int) -> list[int]:
        return self.ids[:keep] + self.ids[keep + 1:]


_cache: dict[int, _AllBut] = {}


def _all_but(vocab_size: int, keep: int) -> list[int]:
    if vocab_size not in _cache:
        _cache[vocab_size] = _AllBut(vocab_size)
    return _cache[vocab_size](keep)


async def forced_token_logprobs(engine, ids: list[int], top: int, vocab_size: int, request_id: str,
                                lora: str | None = None, cache_salt: str | None = None) -> list:
    """The old path: [None, {"token", "logprob", "top": [(id, logprob)]}, ...], one entry per
    prompt token (the first has no context, hence None), one engine request each (with the
    request's LoRA adapter and cache salt, if any)."""
    result: list = [None] * len(ids)

    async def score(i: int):
        params = SamplingParams(max_tokens=1, min_tokens=1, temperature=0.0, ignore_eos=True,
                                stop_token_ids=_all_but(vocab_size, ids[i]), logprobs=top,
                                skip_special_tokens=False)
        # a prefix of a prompt the server checked, with max_tokens 1: it fits where the prompt did
        async for out in engine.generate(ids[:i], params, f"{request_id}-score-{i}", checked=True,
                                         counted=False, lora=lora, cache_salt=cache_salt):
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
