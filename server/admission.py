"""Admission by cost: a request is admitted by the engine sequences it causes, against one
capacity (--max-num-seqs running plus --max-queued-requests waiting); past it, 429 with
Retry-After, before any engine work.

A request's cost is one sequence per choice of each prompt (prompts x n), plus, for echo with
logprobs where the engine cannot score prompt rows, the forced-token requests that score its
prompts (scoring.requests_for: one per prompt token after the first; none where the prefill
scores them). So a flood of echo + logprobs requests is refused as the work it is. A request that
alone costs more than the whole capacity counts as the whole capacity: it waits for an idle
server (429 until then) rather than being refused forever.
"""
from . import scoring
from .protocol import APIError, GenRequest


def cost(req: GenRequest, engine=None) -> int:
    seqs = len(req.prompts) * req.n
    return seqs + sum(scoring.requests_for(engine, req, len(ids)) for ids in req.prompts)


def capacity(config) -> int:
    return config.max_num_seqs + config.max_queued_requests


def admit(state, req: GenRequest):
    """Count the request in, or raise the 429; returns its release (idempotent). Either runs on
    the event loop or on the worker pool (a checked request is admitted and queued there)."""
    limit = capacity(state.config)
    seqs = min(cost(req, state.backend.engine if state.backend is not None else None), limit)
    with state.admission_lock:
        if state.inflight_seqs + seqs > limit:
            raise APIError(429, f"the server is at capacity ({state.inflight_seqs} sequences running or "
                                f"queued, at most {limit}; this request needs {seqs}): retry later", "requests",
                           code="rate_limit_exceeded", headers={"Retry-After": "1"})
        state.inflight_seqs += seqs
    released = False

    def release():
        nonlocal released
        with state.admission_lock:
            if not released:
                released = True
                state.inflight_seqs -= seqs
    return release
