"""Prompt logprobs (SamplingParams.prompt_logprobs, vLLM's): the logprob of every prompt token
after the first, with the top k alternatives, from the rows of the prefill that reads the prompt.

Row p of a sequence's prefill predicts its token p + 1. The engine asks each chunk of a scoring
sequence for the rows that predict prompt tokens (a PromptScore on StepMeta.scores: every row of
a middle chunk, all but the last of the final chunk, whose last row samples the first output);
a runner with `row_logits` fills its entries from those rows' logits, in the step that computes
them (the CPU runner re-runs the plan's logits tail at those rows: compiler/passes/row_logits.py).
An entry is {"token", "logprob", "rank", "top": [(id, logprob)]}; rank is the token's among the
vocabulary (1 = likeliest), as vLLM reports it.
"""
from dataclasses import dataclass, field

import numpy as np


@dataclass
class PromptScore:
    """Prompt logprobs asked of one chunk: its row j predicts prompt token `first + j`, which is
    targets[j]; the runner appends one entry per target to `entries`."""
    first: int                      # prompt position of targets[0]
    targets: list[int]
    k: int                          # top alternatives per entry
    entries: list = field(default_factory=list)


def for_chunk(prompt_ids: list[int], start: int, n: int, k: int) -> PromptScore | None:
    """What a chunk of n tokens from position `start` scores: prompt tokens start+1 .. start+n
    that exist (none for a chunk past the prompt)."""
    targets = prompt_ids[start + 1:start + n + 1]
    return PromptScore(start + 1, targets, k) if targets else None


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float64 logprobs of the last axis (one row or a block of rows)."""
    x = logits.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def top_k(lp: np.ndarray, k: int) -> list[tuple[int, float]]:
    """The k likeliest ids of one row of logprobs, likeliest first (ties: the lower id)."""
    if k <= 0:
        return []
    idx = np.argpartition(-lp, k - 1)[:k] if k < lp.size else np.arange(lp.size)
    idx = idx[np.lexsort((idx, -lp[idx]))]
    return [(int(t), float(lp[t])) for t in idx]


def score_block(logits: np.ndarray, owners: list[tuple[PromptScore, int]]):
    """Fill the entries of a block of rows' logits [R, V]; owners[r] = (its PromptScore, j)."""
    lp = log_softmax(logits)
    for row, (s, j) in zip(lp, owners):
        tok = s.targets[j]
        v = row[tok]
        s.entries.append({"token": tok, "logprob": float(v), "rank": int((row > v).sum()) + 1,
                          "top": top_k(row, s.k)})


def rows_to_score(scores: list, seq_starts) -> tuple[list[int], list[tuple[PromptScore, int]]]:
    """A step's rows to score, in order, and each one's (PromptScore, j); clears the entries."""
    rows, owners = [], []
    for b, s in enumerate(scores):
        if s is not None:
            s.entries = []
            r0 = int(seq_starts[b])
            rows += range(r0, r0 + len(s.targets))
            owners += [(s, j) for j in range(len(s.targets))]
    return rows, owners
