"""The verification of a proposer's k draft tokens against the target's k + 1 scored positions.

Row i of the target's scores is the target's next-token distribution after the context and
draft[:i]; row k is the one after the whole draft (the bonus position). Verification emits the
accepted drafts and then exactly one token of the target's, so a step yields accepted + 1 tokens.

Greedy (temperature 0): a draft is accepted while it equals the target's argmax; the first
mismatch emits the target's argmax there. The output is token-identical to non-speculative greedy.

Sampled (Leviathan et al. 2023, Chen et al. 2023): draft x at position i, drawn by the proposer
from q_i, is accepted with probability min(1, p_i(x) / q_i(x)); on rejection the emitted token is
drawn from normalize(max(p_i - q_i, 0)) and the step ends; with all k accepted the bonus token is
drawn from p_k. Each emitted token then has exactly the distribution p_i: the accepted mass
min(p, q) plus the residual's (1 - sum min(p, q)) * (p - min(p, q)) / (1 - sum min(p, q)) is p.
A deterministic proposer (n-gram) is q = one-hot(x): accept with probability p(x), else draw from
p without x.

In the engine (a deterministic proposer, every row sampled by the runner as a decode row is):
row j draws s_j from p_j with the randomness of (seed, output index of row j), exactly the draw
the non-speculative engine makes for that output index. Accepting d_j with probability p_j(d_j)
and else drawing from p_j without d_j IS accepting while s_j == d_j and emitting s_j at the first
mismatch: P(s_j == d_j) = p_j(d_j), and s_j given s_j != d_j is p_j without d_j, renormalized.
So `accept_sampled` (verify_greedy over the rows' samples) is the rule for greedy and sampled
rows alike, and its output is token for token the non-speculative engine's for the same seed.

A draft model's drafts (draft_model.py) are drawn with the target row's own (seed, index), so
accept_sampled stays exact for them too (the emitted token is always the target's own draw); where
their q reaches the host the engine uses verify_sampled instead, which accepts more
(docs/architecture.md, "Speculative decoding").

p must be the distribution the non-speculative sampler would draw from at that position (the
row's processed logits, with penalties counting the draft tokens before it, through
sampling.filtered_probs: `target_distributions`), and q the one the proposer really drew from.
Pure numpy: the CPU backend uses it as is; the GPU's path must agree with it.
"""
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..logits_process import needs_processing, process_logits
from ..sampling import SamplingParams, filtered_probs

# How far a row's sum may be from 1: an f32 softmax over a 256k vocabulary lands well inside it,
# and a row that is not a distribution at all (logits, log-probs, an unnormalized mask) far outside.
SUM_TOLERANCE = 1e-4


@dataclass(frozen=True)
class Verdict:
    accepted: int          # draft tokens accepted, 0..k
    tokens: list[int]      # the accepted drafts, then the target's token: accepted + 1 tokens


def verify_greedy(target_tokens: Sequence[int], draft: Sequence[int]) -> Verdict:
    """target_tokens: the target's argmax at each of the k + 1 positions; draft: the k drafts."""
    target = _token_list("target_tokens", target_tokens)
    drafts = _token_list("draft", draft)
    if len(target) != len(drafts) + 1:
        raise ValueError(f"verify_greedy: target_tokens must hold len(draft) + 1 = {len(drafts) + 1} "
                         f"tokens (one per draft and the bonus position), got {len(target)}")
    n = 0
    while n < len(drafts) and drafts[n] == target[n]:
        n += 1
    return Verdict(n, drafts[:n] + [target[n]])


def accept_sampled(samples: Sequence, draft: Sequence[int]) -> Verdict:
    """The engine's rule: samples are the k + 1 verify rows' own draws (runner Samples or token
    ids), the draft the k tokens a deterministic proposer fed into rows 1..k. Accepts while the
    row's draw equals the draft; the verdict's tokens are the draws s_0..s_a (see above)."""
    tokens = [s if isinstance(s, (int, np.integer)) else s.token for s in samples]
    return verify_greedy(tokens, draft)


def verify_sampled(target_probs: np.ndarray, draft: Sequence[int], draft_probs: np.ndarray | None,
                   rng: np.random.Generator) -> Verdict:
    """target_probs: [k + 1, V], the target's processed distributions; draft: the k drafts;
    draft_probs: [k, V], the distributions the proposer drew them from, or None for a
    deterministic proposer (q one-hot); rng: the request's generator (its seed makes the result
    reproducible). With k = 0 this draws exactly as sampling.sample does from the same generator."""
    p = _distributions("target_probs", target_probs)
    k1, V = p.shape
    drafts = _token_list("draft", draft, V)
    if len(drafts) != k1 - 1:
        raise ValueError(f"verify_sampled: target_probs must have len(draft) + 1 = {len(drafts) + 1} "
                         f"rows (one per draft and the bonus position), got {k1}")
    q = None
    if draft_probs is not None:
        q = _distributions("draft_probs", draft_probs)
        if q.shape != (len(drafts), V):
            raise ValueError(f"verify_sampled: draft_probs must be [len(draft), V] = "
                             f"[{len(drafts)}, {V}], got {list(q.shape)}")
        zero = [i for i, x in enumerate(drafts) if q[i, x] <= 0]
        if zero:
            raise ValueError(f"verify_sampled: draft token {drafts[zero[0]]} at position {zero[0]} has "
                             f"probability 0 under draft_probs: the proposer cannot have drawn it")
    for i, x in enumerate(drafts):
        qx = 1.0 if q is None else q[i, x]
        if rng.random() * qx < p[i, x]:            # u < p / q: probability min(1, p(x) / q(x))
            continue
        residual = p[i].copy()
        if q is None:
            residual[x] = 0.0
        else:
            residual = np.maximum(residual - q[i], 0.0)
        total = residual.sum()
        # zero only where p == q up to rounding, where a rejection has probability 0 in exact
        # arithmetic: any draw is right then, p's the natural one
        row = residual / total if total > 0 else p[i]
        return Verdict(i, drafts[:i] + [int(rng.choice(V, p=row))])
    return Verdict(len(drafts), drafts + [int(rng.choice(V, p=p[-1]))])


def target_distributions(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """[k + 1, V] processed logits -> the distributions the non-speculative sampler draws from."""
    logits = np.asarray(logits)
    if logits.ndim != 2:
        raise ValueError(f"target_distributions: logits must be [k + 1, V], got shape {list(logits.shape)}")
    return np.stack([filtered_probs(row, params) for row in logits])


def row_distribution(logits: np.ndarray, row) -> np.ndarray:
    """The distribution a runner's row (RowSampling: temperature > 0) draws its token from: its
    logits processed (bias, allowed and banned ids, bitmask) and filtered, as runner.sample_row."""
    x = process_logits(logits, row) if needs_processing(row) else logits
    return filtered_probs(x, row.params)


def verify(logits: np.ndarray, draft: Sequence[int], params: SamplingParams, rng: np.random.Generator,
           draft_probs: np.ndarray | None = None) -> Verdict:
    """The target's [k + 1, V] processed logits verify the draft as params sample: greedy at
    temperature 0 (argmax, as sampling.sample), else the exact rejection rule on filtered_probs."""
    logits = np.asarray(logits)
    if logits.ndim != 2:
        raise ValueError(f"verify: logits must be [k + 1, V], got shape {list(logits.shape)}")
    if params.temperature == 0:
        return verify_greedy(np.argmax(logits, axis=-1), draft)
    return verify_sampled(target_distributions(logits, params), draft, draft_probs, rng)


def _token_list(name: str, tokens: Sequence[int], V: int | None = None) -> list[int]:
    arr = np.asarray(tokens)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(f"{name} must be a 1-d sequence of token ids, got {arr.dtype} of shape {list(arr.shape)}")
    bad = np.flatnonzero((arr < 0) | (arr >= (V if V is not None else np.inf)))
    if bad.size:
        where = "[0, V)" if V is None else f"[0, {V})"
        raise ValueError(f"{name}[{bad[0]}] = {int(arr[bad[0]])} is not a token id in {where}")
    return [int(t) for t in arr]


def _distributions(name: str, probs: np.ndarray) -> np.ndarray:
    """Rows checked to be distributions, renormalized in f64 (the rule divides by them)."""
    p = np.asarray(probs, dtype=np.float64)
    if p.ndim != 2 or p.shape[1] == 0:
        raise ValueError(f"{name} must be [rows, V] with V > 0, got shape {list(p.shape)}")
    if not (p >= 0).all():                        # NaN too; an inf makes its row's sum inf below
        i, v = np.argwhere(~(p >= 0))[0]
        raise ValueError(f"{name}[{i}, {v}] = {p[i, v]}: probabilities must be finite and >= 0")
    sums = p.sum(axis=1)
    off = np.flatnonzero(np.abs(sums - 1.0) > SUM_TOLERANCE)
    if off.size:
        raise ValueError(f"{name} row {off[0]} sums to {float(sums[off[0]])}, not 1 (tolerance "
                         f"{SUM_TOLERANCE}): pass probabilities, not logits")
    return p / sums[:, None]
