"""Data-parallel steps over rank processes: the methods rank 0's MultiProcessRunner
(runtime/distributed/rank_workers.py) takes from DataParallelSteps.

Data-parallel steps (plans with `parallel.dp` > 1: attention data-parallelism with expert
parallelism; `dp_world`): each rank runs its own sequences over its own pages, so each gets its
own StepMeta, all padded by the caller to the same T (runtime/engine/step.py pad_ranks; pad rows write
the spare page `num_pages`), and the experts' collectives (dp_dispatch / dp_combine) run over
every rank's rows. `execute_ranks(metas, sampling)` sends worker r a DP_STEP frame with its step
and its rows' sampling; each rank samples its own rows and the worker's ACK carries its samples,
which rank 0 reads before returning (a data-parallel step is never acknowledged lazily). A
sequence lives on one rank: `free_on(rank, seq_id)` frees it there only.

Overlapped data-parallel steps (`can_overlap`, MultiProcessRunner's rule for its overlapped
steps): the engine calls `handle = launch_ranks(metas, sampling, feeds)` for step k + 1 before
`collect_ranks(handle of step k)`, or collect_ranks(k) alone when it has nothing to launch;
steps are collected in launch order, each once, and at most two are uncollected. feeds[r]: rank
r's (row, prev_row) pairs, the rows whose token is what rank r sampled in row prev_row of its
step before (a runner's `launch` feed). Each worker keeps at most one launched step pending and
answers every frame once, in order:

    DP_LAUNCH(k)   launch k (runner.launch); if step j is pending, collect it and answer with
                   an ACK carrying j's samples, else with a bare ACK of k; k is now pending
    DP_COLLECT(k)  k must be pending: answer with its samples; nothing is pending

Rank 0 sends DP_LAUNCH, launches its own step and keeps its handle, and notes the answer each
worker owes; collect_ranks(k) sends DP_COLLECT(k) only when no later step was launched, then
reads each worker's owed answers in order up to the one with k's samples (bare ACKs are
consumed; any other answer is a ChannelError) and collects rank 0's own. A shared or synchronous
step (execute, launch, logits, execute_ranks) while such a step is uncollected is refused
(RuntimeError, the ranks stay up); close() collects what is in flight first.
"""
import collections

from . import step_channel as ch


class DataParallelSteps:
    """execute_ranks, launch_ranks / collect_ranks and their answers, over MultiProcessRunner's
    sockets, lock and failure handling (self._busy, _guarded, _check_alive, _acks, _recv)."""

    def _init_data_parallel(self):
        # overlapped data-parallel steps (launch_ranks / collect_ranks)
        self._dp_flight: collections.deque = collections.deque()   # LaunchedRanks, launch order
        self._dp_owed: collections.deque = collections.deque()     # every worker's answers owed:
                                                   # (step, carries its samples)
        self._dp_pending: int | None = None        # the step the workers hold, not asked for yet

    # -- data-parallel steps ----------------------------------------------------------------------
    @property
    def dp_world(self) -> int:
        """N for data-parallel rank plans (`parallel.dp` = N > 1: each rank its own step, by
        execute_ranks), else 1 (every rank runs the same step)."""
        par = (getattr(self.runner, "plan", None) or {}).get("parallel") or {}
        dp = int(par.get("dp") or 1)
        return dp if dp > 1 else 1

    def execute_ranks(self, metas: list, sampling: list) -> list:
        """One data-parallel step: rank r runs metas[r] (its own sequences and pages; every rank's
        T the same: runtime/engine/step.py pad_ranks) and samples its own rows by sampling[r]
        ([RowSampling | None] * metas[r].B). Returns every rank's samples, [[Sample | None]] per
        rank. Rank 0 samples locally; each worker sends its samples in the step's ACK, which is
        read here: unlike `execute`, nothing of this step is left to acknowledge later."""
        self._check_ranks(metas, sampling)

        def step():
            self._check_alive()
            self._acks()                        # a lazily acknowledged `execute` before this one
            k = self._step
            for r, s in self.step_socks.items():
                ch.send_frame(s, ch.encode_dp_step(metas[r], k, sampling[r]), f"rank {r}")
            self._step += 1
            # rank 0 runs its step first: the workers wait in its collectives until it does
            mine = self.runner.execute(metas[0], sampling[0])
            theirs = [self._dp_reply(r, k, True, metas[r].B) for r in range(1, self.world)]
            self._acked = k
            return [list(mine)] + theirs
        with self._busy:
            self._refuse_in_flight()
            return self._guarded(step)

    def _check_ranks(self, metas: list, sampling: list):
        """Refuse a malformed data-parallel step before any rank sees it (the ranks stay up)."""
        if self.dp_world == 1:
            raise ValueError("execute_ranks and launch_ranks run data-parallel rank plans "
                             "(parallel.dp > 1); these ranks share every step: use execute")
        if len(metas) != self.world or len(sampling) != self.world:
            raise ValueError(f"{len(metas)} steps and {len(sampling)} sampling lists for "
                             f"{self.world} ranks")
        Ts = [m.T for m in metas]
        if len(set(Ts)) > 1:
            raise ValueError(f"data-parallel ranks' steps must have the same T (pad them: "
                             f"runtime/engine/step.py pad_ranks), got {Ts}")
        for r, (m, rows) in enumerate(zip(metas, sampling)):
            if len(rows) != m.B:
                raise ValueError(f"rank {r}: {len(rows)} sampling rows for a step of {m.B} sequences")

    # -- overlapped data-parallel steps ----------------------------------------------------------
    def launch_ranks(self, metas: list, sampling: list, feeds: list) -> "LaunchedRanks":
        """Launch a data-parallel step whose samples collect_ranks reads later (the engine
        launches step k + 1 before it collects step k). metas, sampling: as execute_ranks;
        feeds[r]: rank r's (row, prev_row) pairs, the rows of metas[r] whose token is what rank r
        sampled in row prev_row of the step launched before (their token ids are placeholders),
        as a runner's launch takes them. Each worker gets a DP_LAUNCH frame and launches the
        step on its runner; rank 0 launches its own. At most two steps are uncollected at once.
        Returns the step's handle for collect_ranks."""
        self._check_ranks(metas, sampling)
        if len(feeds) != self.world:
            raise ValueError(f"{len(feeds)} feeds for {self.world} ranks")
        with self._busy:
            if len(self._dp_flight) >= 2 and self.error is None:
                raise RuntimeError(f"data-parallel steps {[h.step for h in self._dp_flight]} are "
                                   f"launched and uncollected: collect_ranks step "
                                   f"{self._dp_flight[0].step} before launching another")

            def step():
                self._check_alive()
                self._acks()                    # a lazily acknowledged `execute` before this one
                k = self._step
                frames = {r: ch.encode_dp_launch(metas[r], k, sampling[r], feeds[r])
                          for r in self.step_socks}
                for r, s in self.step_socks.items():
                    ch.send_frame(s, frames[r], f"rank {r}")
                self._step += 1
                self._acked = k                 # its answers are read by collect_ranks
                # a worker answers a DP_LAUNCH with the samples of the step it holds launched
                # (collected there now), else with a bare ACK of this step
                self._dp_owed.append((k, False) if self._dp_pending is None else (self._dp_pending, True))
                self._dp_pending = k
                handle = LaunchedRanks(self, k, [m.B for m in metas])
                self._dp_flight.append(handle)
                handle.mine = self.runner.launch(metas[0], sampling[0], feeds[0])
                return handle
            return self._guarded(step)

    def collect_ranks(self, handle: "LaunchedRanks") -> list:
        """Every rank's samples of a step launch_ranks launched, [[Sample | None] * metas[r].B]
        per rank; steps are collected in launch order, each once. The workers' samples come in
        the answer to the next step's DP_LAUNCH, or, when no later step was launched, to a
        DP_COLLECT sent now; rank 0's from its runner's collect."""
        with self._busy:
            if not isinstance(handle, LaunchedRanks) or handle.owner is not self:
                raise ValueError("collect_ranks takes a handle this runner's launch_ranks returned")
            if handle.collected:
                raise RuntimeError(f"data-parallel step {handle.step} was collected already")
            if self.error is None and (not self._dp_flight or self._dp_flight[0] is not handle):
                first = self._dp_flight[0].step if self._dp_flight else None
                raise RuntimeError(f"data-parallel steps are collected in launch order: step "
                                   f"{first} before step {handle.step}")

            def step():
                self._check_alive()
                k = handle.step
                if self._dp_pending == k:       # no later step launched: ask for this one's samples
                    frame = ch.encode_dp_collect(k)
                    for r, s in self.step_socks.items():
                        ch.send_frame(s, frame, f"rank {r}")
                    self._dp_owed.append((k, True))
                    self._dp_pending = None
                mine = self.runner.collect(handle.mine)
                theirs = {}
                while True:                     # the answers owed before this step's samples
                    if not self._dp_owed:
                        raise ch.ChannelError(f"no answer owed carries data-parallel step {k}'s samples")
                    want, has = self._dp_owed.popleft()
                    if has and want != k:
                        raise ch.ChannelError(f"the samples of data-parallel step {want} are owed "
                                              f"before those of step {k} (collected out of order)")
                    for r in self.procs:
                        samples = self._dp_reply(r, want, has, handle.B[r])
                        if has:
                            theirs[r] = samples
                    if has:
                        break
                self._dp_flight.popleft()
                handle.collected = True
                return [list(mine)] + [theirs[r] for r in range(1, self.world)]
            return self._guarded(step)

    def _dp_reply(self, r: int, step: int, has: bool, B: int):
        """Worker r's next answer to a DP_STEP / DP_LAUNCH / DP_COLLECT: step's samples (has),
        else the bare ACK of launched step `step`."""
        kind, items = self._recv(r, self.step_timeout)
        got, samples = ch.dp_reply_of(kind, items)
        if got != step or (samples is not None) != has or (has and len(samples) != B):
            said = "no samples" if samples is None else f"{len(samples)} samples"
            raise ch.ChannelError(f"rank {r} answered with {said} of step {got}, expected "
                                  f"{f'{B} samples' if has else 'no samples'} of step {step}")
        return samples


class LaunchedRanks:
    """A data-parallel step launch_ranks launched: the handle collect_ranks takes."""
    __slots__ = ("owner", "step", "B", "mine", "collected")

    def __init__(self, owner, step: int, B: list):
        self.owner, self.step, self.B = owner, step, B      # B: each rank's rows
        self.mine = None                                    # rank 0's runner's handle
        self.collected = False

    def __repr__(self):
        return f"LaunchedRanks(step={self.step}, B={self.B}{', collected' if self.collected else ''})"
