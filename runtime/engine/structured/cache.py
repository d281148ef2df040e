"""Compiled grammars by request, compiled in worker threads within a time limit.

The engine and the server's door share one GrammarCache: the server awaits `check` (in a thread,
AsyncEngine.check_structured) before it queues a request, so the engine thread finds the grammar
compiled when the request is added. A request's entry is its compile's Future: the same schema
sent again while it compiles waits for that compile rather than starting another; a refusal is
kept too (the same bad schema is refused at once). A compile that outlives the time limit is a
StructuredOutputError for its request; it finishes in its worker (llguidance cannot be
interrupted) and its result serves later requests.
"""
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor, TimeoutError as FutureTimeout

import llguidance
import numpy as np

from infc.config import STRUCTURED_CACHE_SIZE, STRUCTURED_COMPILE_TIMEOUT_S, STRUCTURED_COMPILE_WORKERS

from .compile import cache_key, compile_grammar, kind_of
from .matcher import SequenceGrammar, fill_masks
from .request import StructuredOutputError, StructuredOutputs


def llg_tokenizer(tokenizer, eos_ids, vocab_size: int | None) -> llguidance.LLTokenizer:
    """llguidance's view of the runtime's tokenizer (runtime/tokenization/tokenizer.py: its
    `tk`, a tokenizers.Tokenizer). Its vocabulary is the model's V where the model pads its
    embedding past the tokenizer's ids: the padded ids have no bytes and are never allowed."""
    n_vocab = max(tokenizer.vocab_size, vocab_size or 0)
    return llguidance.LLTokenizer(tokenizer.tk.to_str(), n_vocab=n_vocab, eos_token=sorted(eos_ids) or None)


class GrammarCache:
    def __init__(self, tokenizer, eos_ids, vocab_size: int | None = None,
                 timeout_s: float = STRUCTURED_COMPILE_TIMEOUT_S, size: int = STRUCTURED_CACHE_SIZE,
                 workers: int = STRUCTURED_COMPILE_WORKERS):
        """tokenizer: the runtime's (None: structured outputs are refused); vocab_size: the
        model's V, the width of the rows' bitmasks (None: the tokenizer's)."""
        self.tokenizer, self.eos_ids, self.timeout_s, self.size = tokenizer, set(eos_ids), timeout_s, size
        self.workers = max(1, workers)
        self.vocab_size = vocab_size or (tokenizer.vocab_size if tokenizer is not None else 0)
        self._lock = threading.Lock()
        self._entries: OrderedDict[StructuredOutputs, Future] = OrderedDict()
        self._llg = None
        self._pool = None                         # made on first use: engines without grammars pay nothing

    def llg(self, field: str | None = None) -> llguidance.LLTokenizer:
        """llguidance's tokenizer, built on first use (~0.4 s for a 49k vocabulary).
        StructuredOutputError (naming `field`) where the library cannot read the tokenizer."""
        with self._lock:
            if self._llg is None:
                try:
                    self._llg = llg_tokenizer(self.tokenizer, self.eos_ids, self.vocab_size)
                except Exception as e:          # noqa: BLE001 - the library raises its own types
                    raise StructuredOutputError("structured outputs are not available for this "
                                                f"model's tokenizer: {e}", field) from None
            return self._llg

    def check(self, so: StructuredOutputs):
        """Compile (or find) the request's grammar: StructuredOutputError if it is refused or takes
        longer than the time limit. Safe from any thread; blocks up to the limit."""
        self._template(so)

    def grammar(self, so: StructuredOutputs) -> SequenceGrammar:
        """A new sequence's place in the request's grammar, at its start."""
        return SequenceGrammar(self._template(so).deep_copy(), so.start_after)

    def masks(self, grammars: list[SequenceGrammar]) -> np.ndarray:
        """The active grammars' next-token bitmasks, int32 [len(grammars), ceil(V / 32)]."""
        return fill_masks(grammars, self.vocab_size, self.llg().vocab_size)

    def _template(self, so: StructuredOutputs):
        kind = kind_of(so)
        if self.tokenizer is None:
            raise StructuredOutputError("structured outputs need a tokenizer, and this engine has none", so.field)
        llg = self.llg(so.field)                  # outside the limit: once per engine, not per request
        try:
            return self._future(so, llg).result(self.timeout_s)
        except FutureTimeout:
            raise StructuredOutputError(f"the {kind} took longer than {self.timeout_s:g} s to compile",
                                        so.field) from None

    def _future(self, so: StructuredOutputs, llg) -> Future:
        key = cache_key(so)
        with self._lock:
            fut = self._entries.get(key)
            if fut is not None:
                self._entries.move_to_end(key)
                return fut
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="infc-grammar")
            fut = self._entries[key] = self._pool.submit(compile_grammar, key, llg)
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)
            return fut
