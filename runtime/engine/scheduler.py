"""Continuous batching: which sequences run in the next step, and how many tokens each.

Each step has a token budget (max_num_batched_tokens) and at most max_num_seqs sequences.
Running sequences go first, decodes (one token each) before unfinished prefills, so a long
prompt never stalls the decodes: it is cut into chunks that fill what the budget leaves over.
Waiting sequences are then admitted in arrival order while the budget, the sequence limit and
the free pages allow; admission stops at the first that does not fit (no overtaking).

When a running sequence needs a page and none is free, the most recently admitted running
sequence is preempted by recompute: it gives back its pages and goes to the front of the
waiting queue, keeping its outputs, which are recomputed with its prompt when it returns (its
full blocks usually still sit in the prefix cache then). The oldest sequence only ever
preempts itself if it alone does not fit the cache, which the engine rules out at submission,
so some sequence always makes progress.
"""
from collections import deque

from .block_manager import BlockManager
from .sequence import Sequence, Status


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError(f"need max_num_seqs >= 1 and max_num_batched_tokens >= 1, "
                             f"got {max_num_seqs}, {max_num_batched_tokens}")
        self.bm = block_manager
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []         # in admission order
        self.num_preemptions = 0
        # the tokens left to compute (`load`): the waiting sequences', kept as they come and go;
        # the running ones', counted when asked and kept until the running set changes
        self.waiting_tokens = 0
        self._running_left: int | None = None

    def load(self) -> int:
        """Prompt tokens this scheduler has yet to compute, between steps: what data-parallel
        ranks balance new requests by, a long prompt weighing as much as many short ones. A
        running sequence counts its prefill left (a decode's one token, scheduled or in flight,
        does not)."""
        if self._running_left is None:
            self._running_left = sum(u for s in self.running if (u := s.num_uncomputed) > 1)
        return self.waiting_tokens + self._running_left

    def add(self, seq: Sequence, front: bool = False):
        seq.status = Status.WAITING
        (self.waiting.appendleft if front else self.waiting.append)(seq)
        self.waiting_tokens += seq.num_uncomputed

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[tuple[Sequence, int]]:
        """The next step: (sequence, number of its uncomputed tokens to compute) pairs."""
        budget = self.max_num_batched_tokens
        batch: dict[Sequence, int] = {}
        preempted = False
        for seq in sorted(self.running, key=lambda s: s.num_uncomputed > 1):   # decodes first
            if budget == 0:
                break
            if seq.status is not Status.RUNNING or seq.final:   # preempted earlier in this loop, or
                continue                                     # its last token is still in flight
            n = self.bm.chunk(seq, seq.num_computed_tokens, min(seq.num_uncomputed, budget))
            while not self.bm.grow(seq, n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                budget += batch.pop(victim, 0)
                if victim is seq:
                    break
            else:
                batch[seq] = n
                budget -= n
        # A step that had to preempt admits nobody: the pages just freed are for the running.
        while self.waiting and not preempted and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            queued = seq.num_uncomputed               # before admit() counts its cached prefix
            n = self.bm.admit(seq, budget)
            if n == 0:
                break
            self.waiting.popleft()
            self.waiting_tokens -= queued
            seq.status = Status.RUNNING
            self.running.append(seq)
            batch[seq] = n
            budget -= n
        self._running_left = None                 # the step changes what is left
        return list(batch.items())

    def _preempt(self, seq: Sequence):
        self.running.remove(seq)
        self.bm.release(seq)
        self.add(seq, front=True)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str):
        """Take a sequence out (done or aborted, waiting or running) and free its pages."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
            self._running_left = None
        elif seq.status is Status.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
            self.waiting_tokens -= seq.num_uncomputed
        if seq.pages or seq.slot is not None:
            self.bm.release(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
