"""One sequence's place in its grammar, and the step's bitmasks of the rows that have one.

A sequence with a reasoning section (`start_after`: the ids that end it, e.g. "</think>") runs
unconstrained, its rows with no bitmask, until it has generated them; the grammar applies from
the next token. Masks are llguidance's packed bitmasks (bit v of int32 word v // 32 set: token
v allowed), filled for a step's rows at once by its thread pool, outside the GIL.
"""
import numpy as np
from llguidance import LLExecutor, LLMatcher
from llguidance.numpy import fill_next_token_bitmask_par

_executor = None


def mask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class GrammarError(ValueError):
    """A token the grammar does not allow was sampled (a sampler that ignored the mask)."""


class SequenceGrammar:
    def __init__(self, matcher: LLMatcher, start_after: tuple = ()):
        self.matcher = matcher
        self.start_after = tuple(start_after)
        self.active = not self.start_after         # constraining (the reasoning section is over)
        self._tail: list[int] = []                 # the last tokens, while waiting for start_after

    def accept(self, token: int):
        """The token the sequence sampled; GrammarError if the grammar does not allow it."""
        if not self.active:
            self._tail = (self._tail + [token])[-len(self.start_after):]
            self.active = tuple(self._tail) == self.start_after
            return
        if not self.matcher.consume_token(token):
            raise GrammarError(f"token {token} does not match the grammar: {self.matcher.get_error()}")

    @property
    def finished(self) -> bool:
        """Nothing but EOS may follow: the output is complete (the sequence ends with "stop")."""
        return self.active and self.matcher.is_stopped()


def fill_masks(grammars: list[SequenceGrammar], vocab_size: int, mask_vocab: int) -> np.ndarray:
    """The next-token bitmasks of active grammars, int32 [len(grammars), ceil(vocab_size / 32)].
    mask_vocab: the vocabulary llguidance's tokenizer was built with (>= vocab_size: the model's
    padded ids, which no grammar allows)."""
    global _executor
    if _executor is None:
        _executor = LLExecutor()
    masks = np.zeros((len(grammars), mask_words(mask_vocab)), np.int32)
    fill_next_token_bitmask_par(_executor, [(g.matcher, i) for i, g in enumerate(grammars)], masks)
    return masks[:, :mask_words(vocab_size)]
