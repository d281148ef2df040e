"""The seam between the engine and a backend: run one step, sample the rows that need it.

A runner owns the weights, the paged KV cache and the kernels (or, on the CPU, the numpy
reference executor). The engine owns everything else: which sequences run, their pages, their
stop conditions. Both the CPU and the CUDA runner implement `execute`, and `launch` / `collect`
(`can_overlap`): a step issued now whose samples are read later, so that the engine prepares
the next step while this one runs (engine.Engine, overlap). Where rows' masks need the tokens of
the step in flight (grammars), `launch_forward` issues the step without its sampling and
`launch_sampling` issues that once the masks are known (`can_defer_sampling`).
"""
import time
from dataclasses import dataclass

import numpy as np

from infc.config import DEFAULT_PAGE_SIZE
from infc.compiler.contract import caches
from .logits_process import Penalties, needs_processing, process_logits
from .prompt_logprobs import rows_to_score, score_block, top_k
from .sampling import SamplingParams, logprobs_of, sample
from .step import StepMeta


@dataclass
class RowSampling:
    params: SamplingParams
    seed: int                 # the request's seed (the engine draws one when none was given)
    step: int                 # index of the token being sampled: its randomness is (seed, step)
    banned: tuple = ()        # token ids masked out (EOS/stop ids before min_tokens)
    bitmask: np.ndarray | None = None   # int32 [ceil(V / 32)]: bit v of word v // 32 set = v allowed
    allowed: np.ndarray | None = None   # allowed_token_ids, packed as bitmask is
    penalties: Penalties | None = None  # the row's penalties and token counts (logits_process.py)


@dataclass
class Sample:
    token: int
    logprob: float | None = None
    top: list | None = None   # [(token, logprob)] when logprobs were asked for


@dataclass
class ComputedStep:
    """A step ComputedAtLaunch ran at launch: its samples and how long that took."""
    meta: StepMeta
    samples: list | None
    seconds: float
    logits: np.ndarray | None = None     # launch_forward's, until launch_sampling samples them

    def gpu_ms(self) -> float:
        return self.seconds * 1e3


def feed_tokens(meta: StepMeta, feed, samples: list):
    """Put the fed tokens in meta (a copy of its token ids): row `row` takes the token that
    samples[prev] holds, for each (row, prev) pair of feed (what an overlapped step's engine
    left as placeholders, the launch before's samples not read yet)."""
    if feed:
        meta.tokens = meta.tokens.copy()
        for row, prev in feed:
            meta.tokens[row] = samples[prev].token


class ComputedAtLaunch:
    """The overlapped interface (launch / collect) over `execute`, computed at once: the engine's
    bookkeeping for overlapped steps (tokens fed from the step before, samples read one step
    late) then runs on the CPU exactly as on the GPU, where tests check it against `execute`."""
    can_overlap = True
    _last = None

    def launch(self, meta: StepMeta, sampling: list, feed=()) -> ComputedStep:
        """feed: (row, prev_row) pairs: token `row` is what the launch before sampled in its row
        prev_row (the engine has not read it yet and put a placeholder there)."""
        feed_tokens(meta, feed, self._last.samples if feed else None)
        t0 = time.perf_counter()
        samples = self.execute(meta, sampling)
        self._last = ComputedStep(meta, samples, time.perf_counter() - t0)
        return self._last

    @property
    def can_defer_sampling(self) -> bool:
        """A runner that computes a step's logits apart (`forward`) can sample them later."""
        return callable(getattr(self, "forward", None))

    def launch_forward(self, meta: StepMeta, feed=()) -> ComputedStep:
        """The step's forward only (feed as for launch); launch_sampling samples it."""
        feed_tokens(meta, feed, self._last.samples if feed else None)
        t0 = time.perf_counter()
        logits = self.forward(meta)
        self._last = ComputedStep(meta, None, time.perf_counter() - t0, logits)
        return self._last

    @staticmethod
    def launch_sampling(step: ComputedStep, sampling: list):
        step.samples, step.logits = sample_rows(step.logits, sampling), None

    @staticmethod
    def collect(step: ComputedStep) -> list:
        return step.samples


class CPURunner(ComputedAtLaunch):
    """The numpy reference executor behind the runner interface (paged caches, float32)."""
    # Computed at launch, an overlapped step would only hand its tokens out one step later: the
    # engine steps synchronously over it (tests' runners built on ComputedAtLaunch overlap).
    can_overlap = False
    # no snapshot pool unless __init__ makes one (rank runners built without it keep none)
    num_snapshots = 0
    _state_copies = None

    def __init__(self, plan: dict, weights: dict, num_pages: int, page_size: int = DEFAULT_PAGE_SIZE,
                 max_num_seqs: int = 256, num_state_snapshots: int | None = None):
        """max_num_seqs: state slots to allocate when the plan has slot caches (one per running
        sequence; `num_slots`, 0 for a plan without them), as the CUDA runner does.
        num_state_snapshots: the snapshot pool of such a plan (hybrid prefix caching; None:
        max_num_seqs; 0: none, and no prefix caching for it)."""
        from ..reference.executor import ReferenceExecutor
        self.plan, self.page_size, self.num_pages = plan, page_size, num_pages
        self.vocab_size = plan["config"]["V"]
        self.num_slots = max_num_seqs if caches.has_slots(caches.of_plan(plan)) else 0
        self.num_snapshots = (max_num_seqs if num_state_snapshots is None else num_state_snapshots) \
            if self.num_slots else 0
        self._state_copies = None
        self.executor = ReferenceExecutor(plan, weights, page_size)
        self.executor.allocate_pages(num_pages, page_size, self.num_slots)

    @staticmethod
    def pages_for_budget(plan: dict, page_size: int, budget: int, max_num_seqs: int = 0,
                         num_state_snapshots: int = 0) -> int:
        """Usable pages of the plan's caches (float32 on the CPU) within `budget` bytes, after
        the state slots of max_num_seqs sequences and the snapshot pool (plans with slot caches)."""
        decl = caches.of_plan(plan)
        slots = max_num_seqs + num_state_snapshots if caches.has_slots(decl) else 0
        return caches.pages_for_budget(decl, page_size, budget, slots, itemsize=4)

    @property
    def row_logits(self) -> bool:
        """Whether steps can score prompt rows (meta.scores): the plan names its logits tail."""
        return "row_logits" in self.plan

    def kv_copies(self):
        """Pages to and from host blocks, for the KV tiers (kv_tier/host_copies.py)."""
        from .kv_tier.host_copies import HostCopies
        return HostCopies(self.executor.paged)

    def state_copies(self):
        """The state snapshot pool's copies (plans with slot caches; state_snapshots.py): numpy."""
        if self._state_copies is None and self.num_snapshots:
            self._state_copies = HostStateCopies(self.executor.paged, self.num_snapshots)
        return self._state_copies

    def lora_put(self):
        """The writer of the plan's LoRA tables (runtime/lora/tables.py): the numpy weights."""
        from ..lora.tables import numpy_put
        return numpy_put(self.plan, self.executor.weights)

    def forward(self, meta: StepMeta) -> np.ndarray:
        """The step's logits (its sampling rows); the prompt rows it scores (meta.scores) are
        scored here, in the same pass."""
        if meta.scores and any(meta.scores):
            rows, owners = rows_to_score(meta.scores, meta.seq_starts)
            logits, blocks = self.executor.step_paged(meta, rows)
            for at, block in blocks:
                score_block(block, owners[at:at + len(block)])
            return logits
        return self.executor.step_paged(meta)

    def execute(self, meta: StepMeta, sampling: list[RowSampling | None]) -> list[Sample | None]:
        return sample_rows(self.forward(meta), sampling)

    def outputs(self) -> dict:
        """The last step's plan outputs besides the logits (name -> array): a speculation head's
        hidden states (compiler/passes/capture_hidden.py, specs/eagle3.yaml)."""
        return self.executor.outputs


class HostStateCopies:
    """Running slots to and from a numpy pool of state snapshots (compiler/contract/caches.py
    snapshot_decl); copies are done when issued. The CUDA runner's counterpart, with device copies,
    is runtime/cuda/state_copies.py."""

    def __init__(self, storage: caches.HostCaches, num: int):
        self.storage, self.num, self.itemsize = storage, num, 4      # float32 storage
        self.pool = caches.HostCaches(caches.snapshot_decl(storage.caches), 1, num)
        self.snapshot_bytes = self.pool.block_bytes
        self.pool_bytes = caches.snapshot_pool_bytes(storage.caches, num, self.itemsize)

    def save(self, slot: int, snap: int):
        self.storage.save_state(self.pool, slot, snap)

    def restore(self, snap: int, slot: int):
        self.storage.restore_state(self.pool, snap, slot)

    def tier_copies(self):
        """Snapshots to and from host rows, for the snapshots' KV tiers (as pages are)."""
        from .kv_tier.host_copies import HostCopies
        return HostCopies(self.pool)


def sample_rows(logits: np.ndarray, sampling: list[RowSampling | None]) -> list[Sample | None]:
    return [None if s is None else sample_row(logits[b], s) for b, s in enumerate(sampling)]


def sample_row(logits: np.ndarray, s: RowSampling) -> Sample:
    row = process_logits(logits, s) if needs_processing(s) else logits
    tok = sample(row, s.params, np.random.default_rng((s.seed, s.step)))
    if s.params.logprobs is None:
        return Sample(tok)
    lp = logprobs_of(logits)
    return Sample(tok, float(lp[tok]), top_k(lp, s.params.logprobs))
