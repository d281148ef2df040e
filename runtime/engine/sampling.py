"""Sampling parameters and the numpy sampler of the CPU backend.

Order as in vLLM: temperature, then top-k, top-p and min-p filter the distribution; a request
with a seed draws from its own generator, so its output is reproducible whatever else runs.
"""
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .structured.request import StructuredOutputs

import math

import numpy as np


@dataclass
class SamplingParams:
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                     # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    n: int = 1
    logprobs: int | None = None
    # vLLM's: the logprob of each prompt token after the first, with the top k (0: none); the
    # runner computes them from the prefill's rows (runtime/engine/prompt_logprobs.py)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: "StructuredOutputs | None" = None   # structured/request.py
    # logits processing (logits_process.py, vLLM's meanings and ranges)
    repetition_penalty: float = 1.0    # > 0; over prompt and output tokens
    frequency_penalty: float = 0.0     # [-2, 2]; times each token's count in the output
    presence_penalty: float = 0.0      # [-2, 2]; once for each token in the output
    logit_bias: dict[int, float] | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    best_of: int | None = None         # candidates to draw, the n likeliest returned (best_of.py)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        problems = []
        if self.temperature < 0:
            problems.append(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            problems.append(f"top_k must be -1, 0 or positive, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            problems.append(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            problems.append(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            problems.append(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            problems.append(f"prompt_logprobs must be >= 0, got {self.prompt_logprobs}")
        if self.n < 1:
            problems.append(f"n must be >= 1, got {self.n}")
        if self.best_of is not None and self.best_of < self.n:
            problems.append(f"best_of must be >= n ({self.n}), got {self.best_of}")
        if not self.repetition_penalty > 0:
            problems.append(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                problems.append(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.allowed_token_ids is not None and (
                not self.allowed_token_ids or not all(isinstance(t, int) for t in self.allowed_token_ids)):
            problems.append("allowed_token_ids must be a non-empty list of token ids")
        if self.logit_bias and not all(isinstance(t, int) and isinstance(b, (int, float)) and math.isfinite(b)
                                       for t, b in self.logit_bias.items()):
            problems.append("logit_bias must map token ids (int) to finite numbers")
        if self.bad_words is not None and not all(isinstance(w, str) for w in self.bad_words):
            problems.append("bad_words must be a list of strings")
        if problems:
            raise ValueError("; ".join(problems))


def filtered_probs(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """The distribution sampling draws from, after temperature and the filters."""
    x = logits.astype(np.float64) / p.temperature
    if p.top_k and p.top_k < x.size:
        kth = np.partition(x, -p.top_k)[-p.top_k]
        x = np.where(x < kth, -np.inf, x)
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    if p.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        cum = np.cumsum(probs[order])
        keep = cum - probs[order] < p.top_p          # keep tokens until the mass reaches top_p
        mask = np.zeros_like(probs, dtype=bool)
        mask[order[keep]] = True
        probs = np.where(mask, probs, 0.0)
    if p.min_p > 0:
        probs = np.where(probs >= p.min_p * probs.max(), probs, 0.0)
    return probs / probs.sum()


def sample(logits: np.ndarray, p: SamplingParams, rng: np.random.Generator) -> int:
    if p.temperature == 0:
        return int(np.argmax(logits))
    probs = filtered_probs(logits, p)
    return int(rng.choice(probs.size, p=probs))


def logprobs_of(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())
