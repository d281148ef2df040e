"""The logits processing before sampling, as vLLM's sampler applies it: the numpy reference.

Per row, on the f32 logits, in vLLM's order (v1 Sampler.forward):
  1. masks -> -inf: tokens outside the allowed set (allowed_token_ids, a structured output's
     bitmask), the banned ids (a bad word's last token when its prefix was just generated, EOS
     and stop ids before min_tokens)
  2. logit_bias: x[t] += bias[t]
  3. repetition penalty r, on every token of the prompt or the output: x * (1 / r) where x > 0,
     x * r otherwise
  4. frequency penalty f, over the output: x[t] -= f * count(t)
  5. presence penalty p, over the output: x[t] -= p * (count(t) > 0)
The CPU runner samples from this; the GPU's logits_process kernel computes the same in place
(codegen_templates/triton/logits_process.py.j2). Logprobs handed to clients stay those of the
model's raw distribution (vLLM's default logprobs_mode), computed before any of it.
"""
from dataclasses import dataclass

import numpy as np


@dataclass
class Penalties:
    """A row's penalties and the token counts they read: one entry a distinct token of the
    prompt or the output (sparse: a row pays for the tokens it has seen, not for V)."""
    repetition: float
    frequency: float
    presence: float
    ids: np.ndarray             # int32 [E], distinct
    counts: np.ndarray          # int32 [E]: occurrences in the output
    in_prompt: np.ndarray       # bool [E]


def has_penalties(p) -> bool:
    """Whether SamplingParams p penalizes anything (so its sequences keep token counts)."""
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def pack_bitmask(ids, V: int) -> np.ndarray:
    """int32 [ceil(V / 32)]: bit v % 32 of word v // 32 set for each v in ids (the allowed set)."""
    bits = np.zeros(-(-V // 32) * 32, bool)
    bits[np.asarray(list(ids), np.int64)] = True
    return np.packbits(bits.reshape(-1, 32)[:, ::-1], axis=1).view(">u4").astype(np.uint32).view(np.int32).ravel()


def unpack_bitmask(mask: np.ndarray, V: int) -> np.ndarray:
    """bool [V]: whether each token is allowed (ids past the mask's words are not)."""
    bits = np.unpackbits(np.ascontiguousarray(mask, "<i4").view(np.uint8), bitorder="little")
    out = np.zeros(V, bool)
    out[:min(V, bits.size)] = bits[:V]
    return out


def row_mask(s) -> np.ndarray | None:
    """A row's one bitmask: allowed_token_ids' and a structured output's, both where both are."""
    if s.allowed is None:
        return s.bitmask
    if s.bitmask is None:
        return s.allowed
    return s.allowed & s.bitmask


def bias_arrays(p) -> tuple[np.ndarray, np.ndarray]:
    """A request's logit_bias as (ids int32, bias f32), ids ascending: made once per
    SamplingParams (kept on it), not at every step of every row."""
    if not p.logit_bias:
        return np.zeros(0, np.int32), np.zeros(0, np.float32)
    made = p.__dict__.get("_bias_arrays")
    if made is None or made[0] is not p.logit_bias:
        ids = sorted(p.logit_bias)
        made = (p.logit_bias, np.array(ids, np.int32), np.array([p.logit_bias[t] for t in ids], np.float32))
        p.__dict__["_bias_arrays"] = made
    return made[1], made[2]


def needs_processing(s) -> bool:
    """Whether a row's logits change before sampling (RowSampling s)."""
    return bool(s.banned or s.penalties is not None or s.params.logit_bias
                or s.allowed is not None or s.bitmask is not None)


def process_logits(logits: np.ndarray, s) -> np.ndarray:
    """A row's logits (f32 [V]) after its processing (RowSampling s): a new array."""
    x = np.array(logits, np.float32)
    V = x.size
    mask = row_mask(s)
    if mask is not None:
        x[~unpack_bitmask(mask, V)] = -np.inf
    banned = [t for t in s.banned if 0 <= t < V]
    x[banned] = -np.inf
    ids, bias = bias_arrays(s.params)
    x[ids] += bias
    pen = s.penalties
    if pen is not None and pen.ids.size:
        t = pen.ids
        seen = x[t]
        if pen.repetition != 1.0:
            r = np.float32(pen.repetition)
            hit = pen.in_prompt | (pen.counts > 0)
            seen = np.where(hit, seen * np.where(seen > 0, np.float32(1) / r, r), seen)
        seen = seen - np.float32(pen.frequency) * pen.counts.astype(np.float32)
        seen = seen - np.float32(pen.presence) * (pen.counts > 0).astype(np.float32)
        x[t] = seen
    return x
