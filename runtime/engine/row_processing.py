"""Per sequence, what its rows' logits processing is built from, kept as tokens arrive.

A sequence whose request penalizes keeps one entry per distinct token of its prompt and output
(its output count, whether the prompt has it), updated by each appended token, never recounted.
Its bad words (token sequences, bad_words.py) and its allowed set (a packed bitmask, made once)
are the request's. The engine makes one for each sequence that needs it (`for_request`) and
asks it for each row it samples (`row_fields`).
"""
import numpy as np

from .bad_words import banned_now
from .logits_process import Penalties, has_penalties, pack_bitmask


class RowProcessing:
    def __init__(self, params, prompt_ids, bad_words_ids: list, allowed: np.ndarray | None):
        self.params = params
        self.bad_words_ids = bad_words_ids
        self.longest_prefix = max((len(w) - 1 for w in bad_words_ids), default=0)
        self.allowed = allowed
        self.penalize = has_penalties(params)
        self.ids: list[int] = []
        self.counts: list[int] = []
        self.in_prompt: list[bool] = []
        self.index: dict[int, int] = {}
        self._arrays = None
        if self.penalize:
            for t in dict.fromkeys(prompt_ids):
                self.index[t] = len(self.ids)
                self.ids.append(t)
                self.counts.append(0)
                self.in_prompt.append(True)

    @staticmethod
    def for_request(params, prompt_ids, vocab: int | None, bad_words_ids: list):
        """One sequence's, or None where its rows need no processing of their own."""
        allowed = None if params.allowed_token_ids is None or vocab is None else \
            pack_bitmask(params.allowed_token_ids, vocab)
        if not (has_penalties(params) or bad_words_ids or allowed is not None):
            return None
        return RowProcessing(params, prompt_ids, bad_words_ids, allowed)

    def sibling(self) -> "RowProcessing":
        """Another completion's of the same request, before either has output (n > 1): the
        request's bad words and allowed mask shared, the prompt's entries copied, not recounted."""
        other = object.__new__(RowProcessing)
        other.__dict__.update(self.__dict__)
        other.ids, other.counts, other.in_prompt = list(self.ids), list(self.counts), list(self.in_prompt)
        other.index, other._arrays = dict(self.index), None
        return other

    @property
    def needs_history(self) -> bool:
        """Whether a row needs every output token before it samples (penalties, a bad word of
        several tokens): overlapped, its sampling is deferred until the token before is read
        (Engine._needs_history)."""
        return self.penalize or any(len(w) > 1 for w in self.bad_words_ids)

    def add(self, tok: int):
        """An output token appended to the sequence."""
        if not self.penalize:
            return
        i = self.index.get(tok)
        if i is None:
            self.index[tok] = len(self.ids)
            self.ids.append(tok)
            self.counts.append(1)
            self.in_prompt.append(False)
        else:
            self.counts[i] += 1
        self._arrays = None

    def penalties(self) -> Penalties | None:
        if not self.penalize:
            return None
        if self._arrays is None:
            self._arrays = (np.array(self.ids, np.int32), np.array(self.counts, np.int32),
                            np.array(self.in_prompt, bool))
        p = self.params
        return Penalties(p.repetition_penalty, p.frequency_penalty, p.presence_penalty, *self._arrays)

    def row_fields(self, token_ids: list, num_prompt: int) -> dict:
        """RowSampling's fields for the row sampling after token_ids (the prompt's num_prompt,
        then the output): allowed, penalties, and the bad words' banned ids (the caller joins
        them to its own). Only the output's tail a bad word's prefix can span is read."""
        tail = token_ids[max(num_prompt, len(token_ids) - self.longest_prefix):] if self.longest_prefix else []
        return {"allowed": self.allowed, "penalties": self.penalties(),
                "banned": banned_now(self.bad_words_ids, tail)}
