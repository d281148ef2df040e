"""One sequence: a request's prompt and one of its n completions, and where it stands.

The KV cache holds `num_computed_tokens` of its `token_ids`; the last sampled token is never
in it yet. A step computes `token_ids[num_computed_tokens:]` (or a chunk of it) and samples
only when the chunk reaches the end, so a first prefill, a chunked prefill, a decode and the
recompute after a preemption are one and the same thing.

With overlapped steps (engine.Engine) a sampled token may still be on the device: `pending`
counts it in `num_tokens` (the scheduler runs it as the next decode, its id fed on the device),
and it joins `token_ids` when its step is collected.
"""
import enum
import time

from .sampling import SamplingParams


class PromptIds(list):
    """A prompt's token ids with the int64 array the engine's check made of them (`array`): the
    server checks a request on its worker pool, and the block manager hashes that array on the
    engine thread instead of converting the list again (~0.27 ms at 16k tokens)."""
    __slots__ = ("array",)

    def __init__(self, ids, array):
        super().__init__(ids)
        self.array = array


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, seq_id: int, request_id: str, index: int, prompt_ids: list[int],
                 params: SamplingParams, seed: int, decoder=None, arrival_time: float | None = None):
        self.seq_id, self.request_id, self.index = seq_id, request_id, index
        self.token_ids = list(prompt_ids)          # prompt, then outputs
        self.prompt_array = getattr(prompt_ids, "array", None)   # PromptIds': the prompt as int64
        self.num_prompt_tokens = len(prompt_ids)
        self.params, self.seed = params, seed
        self.status = Status.WAITING
        self.pages: list[int] = []
        self.slot: int | None = None               # its state slot (plans with slot caches), held
                                                   # from admission until finish / abort / preemption
        self.num_computed_tokens = 0               # tokens whose KV is in the cache
        self.num_cached_tokens = 0                 # of those, prefix-cache hits at admission
        self.block_hashes: list[bytes] = []        # prefix hashes of its full blocks (lazily)
        self.block_hasher = None                   # sha256 of the tokens hashed so far
        self.num_committed_blocks = 0              # full computed blocks offered to the cache
        self.pending = 0                           # sampled by a step in flight, not read back yet
        self.pending_row = -1                      # that step's row for this sequence
        self.rank = 0                              # data-parallel ranks: the rank whose KV it has
        self.lora = None                           # (name, lora_id) of its LoRA adapter, or None
        self.cache_salt: str | None = None         # vLLM's cache_salt: its blocks' names start
                                                   # with it, so only requests with the same salt
                                                   # share its cached KV (block_manager._hasher)
        self.lora_slot = 0                         # the adapter's slot while admitted (0: none)
        self.processing = None                     # its rows' logits processing (row_processing.py)
        self.final = False                         # its pending token is its last: schedule no more
        self.grammar = None                        # structured outputs: its SequenceGrammar
        self.finish_reason: str | None = None      # "stop" | "length" | "abort"
        self.stop_reason: int | str | None = None  # the stop token id or stop string matched
        # detokenizer state: the decoder, the text so far, and how much of it was handed out
        self.decoder = decoder
        self.text = ""
        self.sent = 0
        self.logprobs: list | None = [] if params.logprobs is not None else None
        # prompt logprobs, one entry a prompt position (the first None): computed by the first
        # of the n sequences only (its siblings' prompts come from the prefix cache)
        self.prompt_logprobs: list | None = (
            [None] * len(prompt_ids) if params.prompt_logprobs is not None and index == 0 else None)
        # timestamps (time.monotonic) for the metrics
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finish_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + self.pending

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        """Outputs sampled so far, pending ones included."""
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def scores_prompt(self) -> bool:
        """Whether its prompt rows are still to be scored (until its first token is out)."""
        return self.prompt_logprobs is not None and self.first_token_time is None

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def __repr__(self):
        return (f"Sequence({self.seq_id}, {self.request_id!r}#{self.index}, {self.status.value}, "
                f"tokens={self.num_tokens}, computed={self.num_computed_tokens}, pages={len(self.pages)})")
