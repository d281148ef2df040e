"""The engine: requests in, one step at a time, incremental outputs out.

    engine = Engine(runner, tokenizer, eos_ids, max_model_len)
    engine.add_request(prompt_ids, SamplingParams(...), "req-1")
    while engine.has_unfinished():
        for out in engine.step(): ...        # StepOutput: new tokens, text delta, finish reason

It owns the requests, their stop conditions and detokenization; the scheduler decides what runs,
the block manager where its KV lives, and the runner (CPU reference or GPU) computes the step
and samples. Not thread-safe: AsyncEngine drives it from a single thread.

Data-parallel ranks (a runner with `dp_world` N > 1: attention data-parallel plans, compiler/
parallel.py): every sequence lives on one rank, chosen at admission (the one whose prefix cache
holds most of its prompt, else the one with the fewest tokens left to compute), with its pages
in that rank's block manager and its steps in that rank's scheduler. A step is every rank's
batch at once, padded alike (runtime/engine/step.py pad_ranks) and run by `runner.execute_ranks`, each
rank sampling its own rows; overlapped where the runner has `launch_ranks` / `collect_ranks`
(each rank feeding its own pending tokens).

Overlapped steps (a runner with `can_overlap`; INFC_OVERLAP=0 turns it off): step() schedules and
launches step N + 1 before it reads step N's samples back, so the host's work between steps
(scheduling, building the metadata, appending tokens, stop checks, detokenizing) runs while the
GPU computes. A sequence that samples in step N is scheduled in step N + 1 with its new token
still on the device (`Sequence.pending`; the runner copies it into the step's token ids there),
and step() returns step N's outputs. A sequence that stops at step N has computed one token too
many in step N + 1, which is dropped; one whose next token is its last (max_tokens, the context
length) is not scheduled again (`Sequence.final`).

Structured outputs (structured/): a sequence with a grammar has a matcher, fed each token read
back; every row it samples carries its next-token bitmask, and it ends with "stop" once the
grammar is complete. Overlapped, a grammar row's mask needs the token still in flight: such a
step is launched without its sampling (`runner.launch_forward`), the step before is read back and
the matchers advanced while the device computes it, then its sampling is issued with the masks
(`runner.launch_sampling`), as SGLang's overlap scheduler does. Rows with penalties or bad words
of several tokens (RowProcessing.needs_history) need the token before just as much, and take the
same path. Steps without such rows launch as before. A runner that cannot defer its sampling
(data-parallel ranks) reads the step in flight back before such a step is launched.

Speculative decoding (speculative_config, speculative/speculator.py): a decoding sequence's
drafts are verified as extra one-token decode rows of its step, and the accepted ones are emitted
together, one StepOutput a sequence. Steps then run synchronously (no overlap): the proposer
needs each sequence's last token on the host, so every step would read the one in flight first
anyway (vLLM too started n-gram without async scheduling). A draft model (draft_runner) runs its
own k forwards on its own pages before each step; where its drafts are verified by rejection
sampling the step is run as `forward` + sampling, its logits kept for those rows (_execute).
"""
import random
import time
from dataclasses import dataclass

import numpy as np

from infc import envs
from infc.config import KV_SAVE_AHEAD_STEPS

from . import bad_words, fault_inject, kv_events, prompt_logprobs, state_snapshots
from .block_manager import BlockManager
from .kv_tier import tiers as kv_tiers
from .metrics import Metrics
from .row_processing import RowProcessing
from .runner import RowSampling, sample_rows
from .sampling import SamplingParams
from .scheduler import Scheduler
from .sequence import PromptIds, Sequence
from .speculative.eagle_runner import eagle_proposer
from .speculative.speculator import (DraftProposer, Speculator, check_draft_runner, merge_outputs,
                                    refuse_slot_caches)
from .structured.cache import GrammarCache
from .step import Chunk, build_step, pad_ranks
from ..tokenization.tokenizer import IncrementalDecoder
from ..lora.slots import LoraSlots
from ..lora.tables import AdapterNotLoaded

_seeds = random.SystemRandom()


@dataclass
class StepOutput:
    """What one step did for one sequence (completion `index` of request `request_id`)."""
    request_id: str
    index: int
    token_ids: list[int]                   # new tokens
    text: str                              # new text (held back while it may begin a stop string)
    logprobs: list | None = None           # new entries: {"token", "logprob", "top"}
    finish_reason: str | None = None       # "stop" | "length" | "abort" | "error" once it ended
    stop_reason: int | str | None = None
    request_finished: bool = False         # all n sequences of the request ended
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    metrics: dict | None = None            # per-request latencies, on the request's last output
    error: Exception | None = None         # finish_reason "error": why the engine failed the request
    prompt_logprobs: list | None = None    # params.prompt_logprobs: on the request's first output,
                                           # one per prompt token (the first None; prompt_logprobs.py)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Request:
    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams, seqs, arrival,
                 metrics: Metrics):
        self.id, self.prompt_ids, self.params = request_id, prompt_ids, params
        self.metrics = metrics                 # the engine's, or a sink nobody reads (not counted)
        self.seqs: list[Sequence] = seqs
        self.held: list[Sequence] = seqs[1:]   # n > 1: wait until seqs[0] has cached the prompt
        self.arrival_time = arrival
        self.first_token_time: float | None = None


def token_array(prompt_ids) -> np.ndarray:
    """A prompt's ids as int64, in one C loop (a 16k-token list: ~0.3 ms, where a Python min and
    max over it took 0.6 ms and converting it with int() 0.5 ms). ValueError for what is not ids."""
    try:
        return np.fromiter(prompt_ids, np.int64, len(prompt_ids))
    except (TypeError, ValueError, OverflowError):
        raise ValueError("prompt token ids must be integers") from None


def is_fatal(e: BaseException) -> bool:
    """Whether a failure inside a step leaves nothing to go on with: what is not an Exception
    (KeyboardInterrupt, SystemExit), and errors that say the device or the ranks are gone (their
    class sets `engine_fatal`: CudaError, NcclError, RankError, the step channel's)."""
    return not isinstance(e, Exception) or bool(getattr(e, "engine_fatal", False))


def overlaps(runner, overlap: bool | None = None) -> bool:
    """Whether steps over this runner overlap: asked for (None: unless INFC_OVERLAP=0) and the
    runner can (`can_overlap`)."""
    if overlap is None:
        overlap = envs.value("INFC_OVERLAP")
    return bool(overlap and getattr(runner, "can_overlap", False))


class Engine:
    def __init__(self, runner, tokenizer=None, eos_ids=(), max_model_len: int = 1 << 30,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                 enable_prefix_caching: bool = True, log=None, overlap: bool | None = None,
                 kv_offloading: "kv_tiers.OffloadConfig | None" = None,
                 speculative_config=None, draft_runner=None,
                 max_cpu_loras: int | None = None, kv_events_config=None):
        """log(line): where startup notes go (infc/backend.py passes its printer).
        overlap: overlapped steps (see above); default on where the runner can, unless
        INFC_OVERLAP=0. kv_offloading: host and disk tiers for prefix blocks (kv_tier/).
        speculative_config: infc.config.SpeculativeConfig (None: none); a plan with slot caches
        refuses it (ValueError). draft_runner: method "draft_model"'s runner of the draft model
        (infc/backend.py builds it from the config's "model"), of the target's vocabulary.
        kv_events_config: infc.config.KVEventsConfig (None: no events): the prefix cache's KV
        events published for routers, a publisher a data-parallel rank (kv_events.py); close()
        stops them."""
        self.runner, self.tokenizer = runner, tokenizer
        self.dp = int(getattr(runner, "dp_world", 1) or 1)
        self.spec = None
        if speculative_config is not None:
            refuse_slot_caches(runner)
            self.spec = Speculator(speculative_config, max_model_len, getattr(runner, "max_seqs", None),
                                   self._draft(speculative_config, draft_runner, max_num_batched_tokens,
                                               max_model_len, enable_prefix_caching))
            overlap = False
        elif draft_runner is not None:
            raise ValueError("a draft model's runner was given without a speculative config")
        self.overlap = overlaps(runner, overlap) and (
            self.dp == 1 or callable(getattr(runner, "launch_ranks", None)))
        self.in_flight = None                    # overlapped: (batch, rows, the runner's handle, scores)
        self.unsampled = None                    # a launched step whose sampling waits for masks
        self.grammars = GrammarCache(tokenizer, eos_ids, getattr(runner, "vocab_size", None))
        # prompt logprobs need a runner that scores prompt rows in the step (`row_logits`)
        self.scores_prompts = self.dp == 1 and bool(getattr(runner, "row_logits", False))
        self.eos_ids = set(eos_ids)
        self.max_model_len = max_model_len
        self.page_size = runner.page_size
        # A runner whose plan keeps per-sequence state (slot caches: a hybrid model's conv and
        # recurrent state) has num_slots of them; each running sequence holds one.
        self.num_slots = getattr(runner, "num_slots", 0)
        # Prefix caching over slot caches (hybrid models) restores the state where a hit ends from
        # a snapshot kept with the cached block (state_snapshots.py); a runner that keeps none
        # runs such a plan without prefix caching, as issue 12 decided before snapshots.
        copies = None
        if self.num_slots and enable_prefix_caching:
            copies = state_snapshots.snapshot_copies(runner, self.dp, log)
            enable_prefix_caching = copies is not None
        kv_offloading, snap_offloading = state_snapshots.split_offloading(runner, copies, kv_offloading)
        self.tiers = kv_tiers.for_engine(runner, kv_offloading, enable_prefix_caching, self.dp, log)
        if self.tiers is not None:          # write-back: the pages the next steps may take
            self.tiers.write_back(KV_SAVE_AHEAD_STEPS * (-(-max_num_batched_tokens // runner.page_size)
                                                         + max_num_seqs), runner.num_pages)
        self.snapshots = None if copies is None else \
            state_snapshots.for_engine(runner, copies, snap_offloading, self.tiers, log)
        # one block manager and scheduler a data-parallel rank (each its own pages and budget)
        self.bms = [BlockManager(runner.num_pages, runner.page_size, enable_prefix_caching, self.num_slots,
                                 self.tiers) for _ in range(self.dp)]
        for bm in self.bms:
            bm.snapshots = self.snapshots
        self.schedulers = [Scheduler(bm, max_num_seqs, max_num_batched_tokens) for bm in self.bms]
        self.bm, self.scheduler = self.bms[0], self.schedulers[0]
        # a plan built with --enable-lora: the adapters requests may name, in the runner's slots
        self.loras = LoraSlots(runner.plan, runner.lora_put(), max_cpu_loras) \
            if "lora" in getattr(runner, "plan", {}) else None
        for bm in self.bms:
            bm.lora = self.loras
        self.kv_events = kv_events.for_engine(kv_events_config, self.dp, self.page_size,
                                              self.bm.enable_prefix_caching, log)
        if self.kv_events is not None:
            for bm in self.bms:
                bm.events = []
            if self.tiers is not None:           # the host pool's blocks too (one rank: for_engine)
                self.tiers.on_event = lambda ev: self.bm.events.append(ev)
        if self.spec is not None and self.spec.draft is not None:
            self.bm.on_release = self.spec.draft.release   # a shadow goes with its sequence's pages
        self.requests: dict[str, Request] = {}
        self.metrics = Metrics(max_model_len=min(max_model_len, 1 << 30))
        self.metrics.spec_decode_positions = self.spec.k if self.spec else 0
        self.metrics.kv_events = [p.stats for p in self.kv_events] if self.kv_events else None
        self.metrics.cache_config_info = {
            "block_size": self.page_size, "cache_dtype": "auto",
            "enable_prefix_caching": self.bm.enable_prefix_caching,
            "num_gpu_blocks": runner.num_pages, "engine": 0}
        if self.tiers is not None:               # vLLM's CacheConfig spellings
            self.metrics.cache_config_info.update(kv_offloading_size=kv_offloading.host_gib,
                                                  num_cpu_blocks=self.tiers.capacity_rows)
        self._next_seq = 0
        self._next_request = 0
        self.faults = fault_inject.from_env()    # test-only (INFC_FAULT_INJECT); None in production

    def _draft(self, config, draft_runner, max_num_batched_tokens: int, max_model_len: int,
               enable_prefix_caching: bool):
        """The draft_model method's proposer over draft_runner, eagle3's over the head's runner,
        mtp's over the MTP layer's (None for other methods)."""
        if config.method in ("eagle3", "mtp"):            # a head reading the target's hidden states
            if draft_runner is None:
                raise ValueError(f"speculative method {config.method!r}: no runner of the head "
                                 f"{config.model or 'MTP layer'!r} was given (infc/backend.py builds it)")
            if self.dp > 1:
                raise ValueError(f"speculative method {config.method!r} with data-parallel ranks is "
                                 "not supported yet (n-gram speculation is)")
            return eagle_proposer(draft_runner, self.runner, max_num_batched_tokens, max_model_len,
                                  config.method)
        if config.method != "draft_model":
            if draft_runner is not None:
                raise ValueError(f"speculative method {config.method!r} takes no draft model")
            return None
        if draft_runner is None:
            raise ValueError("speculative method 'draft_model': no runner of the draft model "
                             f"{config.model!r} was given (infc/backend.py builds it)")
        if self.dp > 1:
            raise ValueError("speculative method 'draft_model' with data-parallel ranks is not "
                             "supported yet (n-gram speculation is)")
        check_draft_runner(draft_runner, self.runner)
        return DraftProposer(draft_runner, max_num_batched_tokens, max_model_len, enable_prefix_caching)

    # -- requests in ----------------------------------------------------------------------------
    def check_request(self, prompt_ids, params: SamplingParams) -> np.ndarray:
        """Raise ValueError for a request that can never run (pure: safe from any thread).
        prompt_ids: a list of int, or the int64 array token_array made of one. Returns that
        array (PromptIds carries it to the block manager)."""
        n = len(prompt_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        vocab = getattr(self.runner, "vocab_size", None)
        ids = prompt_ids if isinstance(prompt_ids, np.ndarray) else token_array(prompt_ids)
        if vocab is not None:
            if ids.min() < 0 or ids.max() >= vocab:
                raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if n >= self.max_model_len:
            raise ValueError(f"the prompt has {n} tokens: this model's maximum context length is "
                             f"{self.max_model_len} tokens, and at least one must be generated")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and this engine has none")
        if params.logprobs is not None and params.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {params.logprobs}")
        if params.structured_outputs is not None:      # StructuredOutputError (a ValueError)
            self.grammars.check(params.structured_outputs)
        self._check_processing(params, vocab)
        if params.prompt_logprobs is not None and not self.scores_prompts:
            raise ValueError("prompt_logprobs: this backend cannot score prompt rows (its runner has "
                             "no row logits)")
        longest = self.max_model_len if params.max_tokens is None else min(n + params.max_tokens, self.max_model_len)
        kv = self.bm.num_pages * self.page_size
        if self.bm.pages_for(longest - 1) > self.bm.num_pages:   # the last token never enters the KV
            raise ValueError(f"a sequence of up to {longest} tokens ({n} prompt + "
                             f"{'unbounded' if params.max_tokens is None else params.max_tokens} "
                             f"new) can never fit in the KV cache of {kv} tokens: lower max_tokens")
        return ids

    def _check_processing(self, params: SamplingParams, vocab: int | None):
        if params.bad_words and self.tokenizer is None:
            raise ValueError("bad_words need a tokenizer, and this engine has none")
        for name, ids in (("logit_bias", params.logit_bias or ()), ("allowed_token_ids", params.allowed_token_ids or ())):
            if vocab is not None and any(not 0 <= t < vocab for t in ids):
                raise ValueError(f"{name} holds token ids outside the vocabulary [0, {vocab})")

    def checked_ids(self, prompt_ids, params: SamplingParams) -> PromptIds:
        """The prompt as a list of int, once check_request has accepted it with these params
        (ValueError otherwise): one conversion serves both, and the block manager's hashing."""
        ids = token_array(prompt_ids)
        self.check_request(ids, params)
        return PromptIds(ids.tolist(), ids)

    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
                    arrival_time: float | None = None, checked: bool = False, counted: bool = True,
                    lora: str | None = None, cache_salt: str | None = None) -> str:
        """checked: prompt_ids is a list of int that check_request already accepted with these
        params (AsyncEngine.generate's door, or the server's before it): at 16k tokens, the int
        conversion and the vocabulary check cost ~0.5 ms each, once per request is enough.
        counted=False: a request the server makes for itself, left out of the metrics.
        lora: the name of a loaded LoRA adapter to run the request with (None: the base model).
        cache_salt: vLLM's: a non-empty string; only requests with the same salt share the
        prefix cache's blocks with this one (block_manager._hasher)."""
        if params.best_of is not None and params.best_of != params.n:
            raise ValueError("best_of > n is chosen among the engine's outputs by the caller "
                             "(best_of.candidates: the engine draws n = best_of)")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError("cache_salt must be a non-empty string")
        if not checked:
            prompt_ids = self.checked_ids(prompt_ids, params)
        if request_id is None:
            request_id, self._next_request = f"req-{self._next_request}", self._next_request + 1
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        adapter = self._lora(lora)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        seqs = []
        words = bad_words.token_sequences(self.tokenizer, params.bad_words) if params.bad_words else []
        for i in range(params.n):
            seed = params.seed + i if params.seed is not None else _seeds.getrandbits(63)
            dec = IncrementalDecoder(self.tokenizer, params.skip_special_tokens) if self.tokenizer else None
            seqs.append(Sequence(self._next_seq, request_id, i, prompt_ids, params, seed, dec, arrival))
            # its adapter and salt name its blocks: set before any hash is made (_rank_for's too)
            seqs[-1].lora, seqs[-1].cache_salt = adapter, cache_salt
            if params.structured_outputs is not None:
                seqs[-1].grammar = self.grammars.grammar(params.structured_outputs)
            seqs[-1].processing = RowProcessing.for_request(
                params, prompt_ids, getattr(self.runner, "vocab_size", None), words) if i == 0 else \
                seqs[0].processing and seqs[0].processing.sibling()
            self._next_seq += 1
        rank = self._rank_for(seqs[0])
        for s in seqs:                    # siblings share the prompt's cached blocks: one rank
            s.rank = rank
        self.requests[request_id] = Request(request_id, prompt_ids, params, seqs, arrival,
                                            self.metrics if counted else Metrics())
        self.schedulers[rank].add(seqs[0])
        self._gauges()
        return request_id

    def _lora(self, name: str | None):
        """(name, lora_id) of a loaded adapter, None for the base model; ValueError otherwise."""
        if name is None:
            return None
        if self.loras is None:
            raise ValueError(f"LoRA adapter '{name}': this model serves no adapters (build and serve "
                             f"it with --enable-lora)")
        if name not in self.loras.ids:
            raise AdapterNotLoaded(name, f"LoRA adapter '{name}' is not loaded")
        return name, self.loras.ids[name]

    def _rank_for(self, seq: Sequence) -> int:
        """The data-parallel rank a new sequence runs on: the one whose prefix cache holds most of
        its prompt (a prefix is cached on the rank that computed it), then the one with the fewest
        tokens left to compute (Scheduler.load), then the fewest sequences, then the lowest.
        Every rank's step is padded to the longest rank's T, so balancing tokens rather than
        requests is what keeps the ranks' prefills together (bench/NOTES.md: padding fell from
        31 to 25 % of the tokens computed at 256 concurrent ShareGPT-like requests)."""
        if self.dp == 1:
            return 0
        score = [(-bm.cached_blocks(seq), s.load(), len(s.waiting) + len(s.running), r)
                 for r, (bm, s) in enumerate(zip(self.bms, self.schedulers))]
        return min(score)[-1]

    def _sched(self, seq: Sequence) -> Scheduler:
        return self.schedulers[seq.rank]

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is; its pages are freed now. False if it is not here."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        for seq in req.seqs:
            if not seq.finished:
                self._sched(seq).finish(seq, "abort")
        self._count_finish(req, "abort")
        self._gauges()
        return True

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- one step -------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        try:
            return self._step()
        finally:
            self.metrics.end_iteration()
            self._publish_events()

    # -- the prefix cache's KV events -----------------------------------------------------------
    def _publish_events(self):
        """Each rank's events of the step, to its publisher's queue (kv_events.py: never waits)."""
        if self.kv_events is not None:
            for bm, pub in zip(self.bms, self.kv_events):
                if bm.events:
                    events, bm.events = bm.events, []
                    pub.publish(events)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block on every rank (vLLM's reset_prefix_cache; running
        sequences keep their pages); subscribers get AllBlocksCleared."""
        for bm in self.bms:
            bm.reset_prefix_cache()
        self._publish_events()
        return True

    def close(self):
        """Stop what the engine itself runs: the KV-event publishers (their queued events sent
        first, within a second). The runner is its owner's to close."""
        pubs, self.kv_events = self.kv_events, None
        for bm in self.bms:
            bm.events = None
        if self.tiers is not None:
            self.tiers.on_event = None
        for p in pubs or ():
            p.close()

    def _step(self) -> list[StepOutput]:
        """Run a step; the outputs of the step (overlapped: of the step before) that sampled. With
        data-parallel ranks, a step is every rank's batch, padded alike, run together.

        A failure fails what it concerns, and the engine goes on (issue 39): one request's output
        handling (stop checks, detokenizing, logprobs) ends that request; a step lost in the
        runner ends the requests of that step and of the step in flight with it. Their last
        StepOutput carries the error (finish_reason "error"). What is fatal (is_fatal: the device
        or the ranks are gone) is raised: the engine is dead."""
        batches = [s.schedule() for s in self.schedulers]
        failed = self._fail_lora_waiters()
        if failed:                              # a sibling of an ended request may sit in a batch
            batches = [[(seq, n) for seq, n in b if not seq.finished] for b in batches]
        if self.spec is not None:
            self.spec.begin()
            batches = [self.spec.extend(b, s, s.bm, self._speculates, self._row)
                       for b, s in zip(batches, self.schedulers)]
        self.metrics.num_preemptions_total = sum(s.num_preemptions for s in self.schedulers)
        if not any(batches) and self.in_flight is None:
            if not failed and any(s.has_work() for s in self.schedulers):
                raise RuntimeError("the scheduler made no progress with work waiting (a bug)")
            if failed:
                self._gauges()
            return failed
        launched, outputs = None, failed
        if self.in_flight is not None and self._reads_first(batches):
            outputs += self._drain_in_flight()
            batches = [[(seq, n) for seq, n in b if not seq.finished] for b in batches]   # ended in it
        try:
            if self.tiers is not None:          # before the step: its restores, the saves it overwrites
                self.tiers.flush(self.bm.blocks, before_launch=True)
            if self.snapshots is not None:      # the admitted sequences' state, where their hits end
                self.snapshots.before_launch()
            launched = self._launch_any(batches) if any(batches) else None
        except Exception as e:                  # noqa: BLE001 - this step is lost, not the engine
            if is_fatal(e):
                raise
            outputs += self._fail_batches(batches, e)
            self.unsampled = None               # a forward launched for it is never sampled
            if self.in_flight is not None:      # the step before still runs: read it back
                outputs += self._drain_in_flight(e)
            self._gauges()
            return outputs
        before, self.in_flight = self.in_flight, None
        try:
            if before is not None:              # a deferred sampling is issued inside, once its tokens are in
                outputs += (self._collect(*before, then=self._sample_deferred) if self.dp == 1
                            else self._collect_any(*before))
            self._sample_deferred()             # (if not issued there) its masks needed the tokens just read
            if launched is not None and not self.overlap:
                outputs += self._collect_any(*launched)
            else:
                self.in_flight = launched
        except Exception as e:                  # noqa: BLE001 - reading back failed: both steps lost
            if is_fatal(e):
                raise
            outputs += self._fail_batches([b for x in (before, launched) if x is not None
                                           for b in self._batches_of(x)], e)
            self.in_flight = launched if self.overlap else None
            if self.in_flight is not None:
                outputs += self._drain_in_flight(e)
        if self.tiers is not None:              # the blocks this step released go to the host now
            self.tiers.flush(self.bm.blocks)
        if self.snapshots is not None:
            self.snapshots.after_step()
        self._gauges()
        return outputs

    def _fail_lora_waiters(self) -> list[StepOutput]:
        """End the requests whose adapter could not take a slot when they were admitted
        (LoraSlots.admit): unloaded while they waited, or no longer readable from its directory
        (the host cache had dropped it). Their failure, named, not the engine's."""
        if self.loras is None or not self.loras.failed:
            return []
        failed, self.loras.failed = self.loras.failed, []
        return [out for seq, e in failed if (out := self._fail_request(seq.request_id, e)) is not None]

    def _batches_of(self, launched) -> list:
        """A launched step's batches, one a data-parallel rank."""
        return list(launched[0]) if self.dp > 1 else [launched[0]]

    def _launch_any(self, batches) -> tuple:
        return self._launch_ranks(batches) if self.dp > 1 else self._launch(batches[0])

    def _collect_any(self, *launched) -> list[StepOutput]:
        return self._collect_ranks(*launched) if self.dp > 1 else self._collect(*launched)

    def _drain_in_flight(self, error: Exception | None = None) -> list[StepOutput]:
        """Read back the step in flight after a lost step (error), so the runner holds no handle
        of it, or before a step whose masks need its tokens (_reads_first): its surviving
        sequences' tokens as usual; if that fails too, its requests fail."""
        launched, self.in_flight = self.in_flight, None
        try:
            self._sample_deferred()
            return self._collect_any(*launched)
        except Exception as e:                  # noqa: BLE001
            if is_fatal(e):
                raise
            return self._fail_batches(self._batches_of(launched), error or e)

    # -- rows whose sampling needs the token before: grammars, penalties -------------------------
    @staticmethod
    def _needs_history(seq: Sequence) -> bool:
        """A grammar's mask, or penalties / a bad word of several tokens (RowProcessing), depend
        on every token before the one sampled."""
        return seq.grammar is not None or (seq.processing is not None and seq.processing.needs_history)

    def _speculates(self, seq: Sequence) -> bool:
        """Whether a decoding sequence may verify drafts: not a row that needs the tokens before
        it (its later rows' masks or penalties would need the drafts accepted), not one whose
        prompt rows are still being scored."""
        return not self._needs_history(seq) and not seq.scores_prompt

    def _reads_first(self, batches) -> bool:
        """Whether the step in flight must be read back before these batches launch: a row needs
        its token (_needs_history), and the runner cannot sample after launching."""
        if self.dp == 1 and getattr(self.runner, "can_defer_sampling", False):
            return False
        return any(seq.pending and self._needs_history(seq) for batch in batches for seq, _ in batch)

    def _history_rows(self, batch, rows) -> list:
        """(row, sequence) of the rows that sample and need the token before."""
        return [(b, seq) for b, ((seq, _), row) in enumerate(zip(batch, rows))
                if row is not None and self._needs_history(seq)]

    def _fill_masks(self, rows, history_rows, refresh: bool = False):
        """Set the bitmask of each row whose grammar constrains its next token (a sequence that
        ended since it was scheduled samples a dropped row: no mask). refresh: the rows were made
        before the token before was read (deferred sampling): their penalties, bad words and
        allowed ids are made again from the sequence as it is now."""
        alive = [(b, seq) for b, seq in history_rows if not seq.finished]
        if refresh:
            for b, seq in alive:
                if seq.processing is not None and seq.processing.needs_history:
                    self._set_processing(rows[b], seq)
        live = [(b, seq.grammar) for b, seq in alive if seq.grammar is not None and seq.grammar.active]
        if live:
            masks = self.grammars.masks([g for _, g in live])
            for (b, _), mask in zip(live, masks):
                rows[b].bitmask = mask

    def _sample_deferred(self):
        """Issue the sampling of the step launched without it, its rows made from the sequences
        now fed the tokens of the step before (grammar masks, penalties)."""
        if self.unsampled is not None:
            (handle, rows, history_rows), self.unsampled = self.unsampled, None
            self._fill_masks(rows, history_rows, refresh=True)
            self.runner.launch_sampling(handle, rows)

    def _fail_batches(self, batches, error: Exception) -> list[StepOutput]:
        """Fail every request with a sequence in these batches (lists of (sequence, tokens))."""
        ids = dict.fromkeys(seq.request_id for batch in batches for seq, _ in batch)
        return [out for rid in ids if (out := self._fail_request(rid, error)) is not None]

    def _fail_request(self, request_id: str, error: Exception) -> StepOutput | None:
        """End a request with an error: aborted (its pages freed now), counted as "error"."""
        req = self.requests.pop(request_id, None)
        if req is None:                          # finished or aborted already
            return None
        for seq in req.seqs:
            if not seq.finished:
                self._sched(seq).finish(seq, "error")
        self._count_finish(req, "error")
        return StepOutput(request_id, 0, [], "", finish_reason="error", request_finished=True,
                          num_prompt_tokens=len(req.prompt_ids), error=error)

    def _launch_ranks(self, batches) -> tuple:
        built = [self._chunks(b) for b in batches]
        if self.faults is not None:
            for b in batches:
                self.faults.on_step(b)
        metas = pad_ranks([m for m, _, _ in built], self.runner.num_pages, self.page_size)
        rows = [r + [None] * (m.B - len(r)) for (_, r, _), m in zip(built, metas)]   # pad rows sample nothing
        for batch, r in zip(batches, rows):        # every token known (_reads_first)
            self._fill_masks(r, self._history_rows(batch, r))
        if self.overlap:
            handle = self.runner.launch_ranks(metas, rows, [f for _, _, f in built])
        else:
            handle = self.runner.execute_ranks(metas, rows)
        for batch, (_, r, _) in zip(batches, built):
            self._launched(batch, r)
        return batches, [r for _, r, _ in built], handle

    def _collect_ranks(self, batches, rows, handle) -> list[StepOutput]:
        samples = self.runner.collect_ranks(handle) if self.overlap else handle
        outputs = []
        for batch, r, s in zip(batches, rows, samples):
            outputs += self._collect(batch, r, s[:len(r)], read=False)
        return outputs

    def _launch(self, batch) -> tuple:
        """Issue a step (overlapped: its tokens not read yet): (batch, rows, handle, scores)."""
        meta, rows, feed = self._chunks(batch)
        if self.faults is not None:
            self.faults.on_step(batch)
        history_rows = self._history_rows(batch, rows)
        if self.overlap and any(seq.pending for _, seq in history_rows):
            handle = self.runner.launch_forward(meta, feed)        # sampled in step(), tokens known
            self.unsampled = (handle, rows, history_rows)
        else:
            self._fill_masks(rows, history_rows)
            handle = self.runner.launch(meta, rows, feed) if self.overlap else self._execute(meta, rows)
        self._launched(batch, rows)
        return batch, rows, handle, meta.scores

    def _execute(self, meta, rows) -> list:
        """A synchronous step's samples; where drafts are verified by rejection sampling, from
        the runner's logits (`forward`), which the speculator keeps for them."""
        if self.spec is None or not self.spec.rejects() or not callable(getattr(self.runner, "forward", None)):
            samples = self.runner.execute(meta, rows)
        else:
            logits = self.runner.forward(meta)
            self.spec.keep_logits(logits, rows)
            samples = sample_rows(logits, rows)
        if self.spec is not None:
            self.spec.observe(self.runner)          # a head's target hidden states (eagle3)
        return samples

    def _chunks(self, batch) -> tuple:
        """A batch's step: (StepMeta, rows' sampling, feed of pending tokens)."""
        now = time.monotonic()
        chunks, rows, feed, scores = [], [], [], []
        at = 0                                      # the chunk's first row among the step's tokens
        drafts = self.spec.drafts if self.spec is not None else {}
        for seq, n in batch:
            start = seq.num_computed_tokens
            if seq.seq_id in drafts:                # its own row here, its draft rows at the end
                n = 1
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
            tokens = seq.token_ids[start:start + n]
            if len(tokens) < n:                     # its last token is still on the device
                assert seq.pending == 1 and len(tokens) == n - 1, seq
                feed.append((at + n - 1, seq.pending_row))
                tokens.append(0)
            chunks.append(Chunk(seq.seq_id, tokens, start))
            scores.append(prompt_logprobs.for_chunk(seq.token_ids[:seq.num_prompt_tokens], start, n,
                                                    seq.params.prompt_logprobs)
                          if seq.scores_prompt else None)
            samples_now = start + n == seq.num_tokens
            rows.append(self._row(seq) if samples_now else None)
            at += n
        if drafts:
            self.spec.add_rows(batch, chunks, rows, self._row, Chunk)
            scores += [None] * (len(chunks) - len(scores))      # draft rows score no prompt
        pages = {seq.seq_id: seq.pages for seq, _ in batch}
        slots = {seq.seq_id: seq.slot for seq, _ in batch} if self.num_slots else None
        meta = build_step(chunks, pages.__getitem__, self.page_size,
                          slot_of=slots.__getitem__ if slots else None)
        if self.spec is not None:
            self.spec.layout = [(c.seq_id, c.start, len(c.tokens)) for c in chunks]
        if any(scores):
            meta.scores = scores
        if self.loras is not None:          # per chunk: a sequence's draft rows sit at the end
            slot = {seq.seq_id: seq.lora_slot for seq, _ in batch}
            meta.lora_slots = np.repeat(np.fromiter((slot[c.seq_id] for c in chunks), np.int32, len(chunks)),
                                        [len(c.tokens) for c in chunks]).astype(np.int32)
        return meta, rows, feed

    def _launched(self, batch, rows):
        """The batch's sequences after their step was issued."""
        saves = []
        for b, ((seq, n), row) in enumerate(zip(batch, rows)):
            seq.num_computed_tokens += n
            # blocks whose ids are all known are offered now, as the synchronous engine does
            # before it schedules the next step: a request admitted then finds them (it runs
            # after this step on the stream). A block with the pending token waits for _collect.
            self.bms[seq.rank].commit(seq)
            if self.snapshots is not None and (h := self._snapshot_at(seq, n)) is not None:
                saves.append((h, seq.slot))
            if row is not None:
                seq.pending += 1
                seq.pending_row = b
                seq.final = self._at_length(seq, seq.num_tokens)
        if saves:                               # the state this step leaves: before the next one runs
            self.snapshots.save(saves)

    def _snapshot_at(self, seq: Sequence, n: int) -> bytes | None:
        """The hash of the block a step of n tokens just ended seq's state on, when it is to be
        snapshotted: a prefill chunk's end on a block boundary whose tokens are all known (decode
        steps cross a boundary every page_size tokens: a snapshot each would cost far more than
        the blocks' KV, so none)."""
        c = seq.num_computed_tokens
        if c % self.page_size or not 0 < c <= len(seq.token_ids) or (n == 1 and c > seq.num_prompt_tokens):
            return None
        return self.bms[seq.rank].block_hash(seq, c // self.page_size - 1)

    def _collect(self, batch, rows, handle, scores=None, read: bool = True, then=None) -> list[StepOutput]:
        """Read a launched step's samples back (read=False: handle is the samples); append them,
        check stops, offer full blocks. scores: the step's PromptScores, one a chunk.

        then: called once every token is appended (and fed to its grammar and penalty counts),
        before the stop checks and detokenizing: the deferred sampling of the step launched
        after this one (_sample_deferred) is issued there, so the GPU waits for the masks only,
        not for this step's output handling."""
        samples = self.runner.collect(handle) if self.overlap and read else handle
        if self.spec is not None and self.spec.drafts:
            samples = self.spec.group(batch, samples)   # a speculating sequence's: its rows' list
        now = time.monotonic()
        outputs = []
        for (seq, _), score in zip(batch, scores or ()):
            if score is not None and seq.prompt_logprobs is not None:
                seq.prompt_logprobs[score.first:score.first + len(score.entries)] = score.entries
        taken, failed = [], {}
        for (seq, n), sample in zip(batch, samples):
            if sample is not None:
                seq.pending -= 1
            if seq.finished or sample is None:      # stopped at the step before, aborted, or a
                continue                            # prefill chunk (its blocks offered at launch)
            if isinstance(sample, list):            # verified drafts (synchronous steps only)
                outputs.append(self._collect_verified(seq, sample, now))
                continue
            taken.append((seq, sample))
            try:
                if self.faults is not None:
                    self.faults.on_token(seq)
                seq.token_ids.append(sample.token)
                if seq.grammar is not None:
                    seq.grammar.accept(sample.token)
                if seq.processing is not None:
                    seq.processing.add(sample.token)
                self.bms[seq.rank].commit(seq)      # the block its pending token completes
            except Exception as e:                  # noqa: BLE001 - this request's, not the step's
                if is_fatal(e):
                    raise
                failed[seq.seq_id] = e
                seq.grammar = None                  # it fails below: no mask of a broken matcher
        if then is not None:
            then()
        for seq, sample in taken:
            e = failed.get(seq.seq_id)
            if e is None:
                try:
                    outputs.append(self._append(seq, sample, now))
                    continue
                except Exception as err:            # noqa: BLE001 - this request's, not the step's
                    if is_fatal(err):
                        raise
                    e = err
            # its request may have ended inside _append, its last output not handed out
            outputs.append(self._fail_request(seq.request_id, e) or StepOutput(
                seq.request_id, seq.index, [], "", finish_reason="error", request_finished=True,
                num_prompt_tokens=seq.num_prompt_tokens, error=e))
        return outputs

    def _collect_verified(self, seq: Sequence, samples: list, now: float) -> StepOutput:
        """A speculating sequence's rows read back: the accepted tokens appended and checked for
        stops one by one (those after a stop dropped), its rejected rows rolled back."""
        try:
            outs = []
            accepted = self.spec.settle(seq, samples, self.bms[seq.rank], self.requests[seq.request_id].metrics)
            for sample in accepted:
                if self.faults is not None:
                    self.faults.on_token(seq)
                seq.token_ids.append(sample.token)
                if seq.processing is not None:
                    seq.processing.add(sample.token)
                self.bms[seq.rank].commit(seq)
                outs.append(self._append(seq, sample, now))
                if seq.finished:
                    break
            return merge_outputs(outs)
        except Exception as e:                      # noqa: BLE001 - this request's, not the step's
            if is_fatal(e):
                raise
            return self._fail_request(seq.request_id, e) or StepOutput(
                seq.request_id, seq.index, [], "", finish_reason="error", request_finished=True,
                num_prompt_tokens=seq.num_prompt_tokens, error=e)

    def _row(self, seq: Sequence, step: int | None = None) -> RowSampling:
        """The sampling of a sequence's next token (or of its output index `step`: a draft row),
        its logits processing included."""
        step = seq.num_output_tokens if step is None else step
        row = RowSampling(seq.params, seq.seed, step, self._banned(seq, step))
        if seq.processing is not None:
            self._set_processing(row, seq)
        return row

    def _set_processing(self, row: RowSampling, seq: Sequence):
        """The row's penalties, allowed and banned ids from the sequence's tokens read so far (made
        again when its sampling was deferred: row.step is still the index it samples)."""
        fields = seq.processing.row_fields(seq.token_ids, seq.num_prompt_tokens)
        row.allowed, row.penalties = fields["allowed"], fields["penalties"]
        base = self._banned(seq, row.step)
        row.banned = tuple(sorted(set(base) | set(fields["banned"]))) if fields["banned"] else base

    def _banned(self, seq: Sequence, step: int | None = None) -> tuple:
        """EOS and stop ids while the token at index `step` (default: the next) is before
        min_tokens."""
        p = seq.params
        if (seq.num_output_tokens if step is None else step) >= p.min_tokens:
            return ()
        return tuple(sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_ids)))

    def _append(self, seq: Sequence, sample, now: float) -> StepOutput:
        """Account for a token just appended to seq.token_ids."""
        req = self.requests[seq.request_id]
        tok = sample.token
        m = req.metrics
        m.token(None if seq.first_token_time is None else now - seq.last_token_time)
        if seq.first_token_time is None:
            seq.first_token_time = now
            if req.first_token_time is None:
                req.first_token_time = now
                m.first_token(len(req.prompt_ids), req.arrival_time, seq.first_scheduled_time, now)
            if seq.index == 0 and req.held:      # the prompt's blocks are cached now: siblings go
                for s in reversed(req.held):
                    self._sched(s).add(s, front=True)
                req.held = []
        seq.last_token_time = now
        new_lp = None
        if seq.logprobs is not None:
            new_lp = [{"token": tok, "logprob": sample.logprob, "top": sample.top}]
            seq.logprobs += new_lp

        reason = self._check_stop(seq, tok)
        if reason is not None:
            self._finish(seq, reason, now)
        first = len(seq.token_ids) == seq.num_prompt_tokens + 1        # its first output token
        out = StepOutput(seq.request_id, seq.index, [tok], self._text_delta(seq), new_lp,
                         seq.finish_reason, seq.stop_reason, num_prompt_tokens=seq.num_prompt_tokens,
                         num_cached_tokens=seq.num_cached_tokens,
                         prompt_logprobs=seq.prompt_logprobs if first else None)
        if seq.finished and all(s.finished for s in req.seqs):
            del self.requests[req.id]
            self._count_finish(req, reason)
            scheduled = min(s.first_scheduled_time for s in req.seqs)
            m.completed(len(req.prompt_ids), sum(len(s.output_ids) for s in req.seqs), req.arrival_time,
                        scheduled, req.first_token_time, now)
            out.request_finished = True
            out.metrics = {"arrival_time": req.arrival_time, "first_token_time": req.first_token_time,
                           "finish_time": now, "ttft": req.first_token_time - req.arrival_time,
                           "e2e": now - req.arrival_time, "queue_time": scheduled - req.arrival_time}
        return out

    def _check_stop(self, seq: Sequence, tok: int) -> str | None:
        """Stop conditions after appending tok; detokenizes tok unless it is a stop token."""
        p = seq.params
        outputs = len(seq.token_ids) - seq.num_prompt_tokens   # read back so far (not pending)
        may_stop = outputs > p.min_tokens     # the first min_tokens never stop
        if may_stop and ((tok in self.eos_ids and not p.ignore_eos) or tok in p.stop_token_ids):
            seq.stop_reason = tok if tok in p.stop_token_ids else None
            if p.include_stop_str_in_output and seq.decoder is not None:
                seq.text += seq.decoder.push(tok)
            return "stop"                         # the stop token's text is not part of the output
                                                  # unless include_stop_str_in_output
        if seq.decoder is not None:
            before = len(seq.text)
            seq.text += seq.decoder.push(tok)
            if p.stop and may_stop:
                longest = max(len(s) for s in p.stop)
                window = max(0, before - longest + 1)      # a stop string may straddle tokens
                hits = [(at, s) for s in p.stop if (at := seq.text.find(s, window)) >= 0]
                if hits:
                    at, s = min(hits)
                    seq.text = seq.text[:at + (len(s) if p.include_stop_str_in_output else 0)]
                    seq.stop_reason = s
                    return "stop"
        if seq.grammar is not None and seq.grammar.finished:
            return "stop"                         # the output is complete: only EOS could follow
        if self._at_length(seq, len(seq.token_ids)):
            return "length"
        return None

    def _at_length(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether a sequence of num_tokens tokens (prompt included) has reached max_tokens or the
        context length: the finish "length" once read back, `final` while still pending."""
        p = seq.params
        return ((p.max_tokens is not None and num_tokens - seq.num_prompt_tokens >= p.max_tokens)
                or num_tokens >= self.max_model_len)

    def _text_delta(self, seq: Sequence) -> str:
        # While a stop string could still be completing, its first characters are held back.
        hold = 0 if seq.finished or not seq.params.stop else max(len(s) for s in seq.params.stop) - 1
        end = max(seq.sent, len(seq.text) - hold)
        delta, seq.sent = seq.text[seq.sent:end], end
        return delta

    def _finish(self, seq: Sequence, reason: str, now: float):
        self._sched(seq).finish(seq, reason)
        seq.finish_time = now

    def _count_finish(self, req: Request, reason: str):
        req.metrics.finished(reason)

    def _gauges(self):
        m = self.metrics
        counted = {rid for rid, r in self.requests.items() if r.metrics is m}
        m.num_requests_running = len({q.request_id for s in self.schedulers for q in s.running} & counted)
        m.num_requests_waiting = len(counted) - m.num_requests_running
        m.kv_cache_usage_perc = sum(bm.usage for bm in self.bms) / len(self.bms)
        m.prefix_cache_queries_total = sum(bm.query_tokens for bm in self.bms)
        m.prefix_cache_hits_total = sum(bm.hit_tokens for bm in self.bms)
        if self.tiers is not None:
            st = m.kv_offload = self.tiers.stats
            m.external_prefix_cache_queries_total = m.prefix_cache_queries_total - m.prefix_cache_hits_total
            m.external_prefix_cache_hits_total = st.host_hit_tokens + st.disk_hit_tokens
        if self.loras is not None:
            running = {q.lora[0] for s in self.schedulers for q in s.running if q.lora}
            waiting = {q.lora[0] for s in self.schedulers for q in s.waiting if q.lora}
            m.lora_requests_info = {"running_lora_adapters": ",".join(sorted(running)),
                                    "waiting_lora_adapters": ",".join(sorted(waiting)),
                                    "max_lora": str(self.loras.max_loras)}
