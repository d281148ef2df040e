"""One process per rank: rank 0 (this process) owns the engine, scheduler and sampler and runs
rank 0's runner; it spawns ranks 1..N-1 as worker processes and sends each step's StepMeta to
them over runtime/distributed/step_channel.py (raw frames on local sockets, no pickle). Every rank runs the
same step on its own runner; the collectives inside the step keep the ranks in lockstep (NCCL on
the GPUs; on the CPU, tests' numpy references exchange their inputs through rank 0).

Overlapped steps (engine.Engine; on for GPU ranks, INFC_RANK_OVERLAP=0 or INFC_OVERLAP=0 turns
them off; +10-12 % on two H100s, bench/NOTES.md): rank 0 launches step N + 1 before it reads step
N's tokens, so the workers get a LAUNCH frame, the step and its rows' sampling; every rank samples
every row (the ranks' logits are the same bits, so are the tokens) and feeds the next step's
pending tokens on its own device.

Data-parallel steps (plans with `parallel.dp` > 1): runtime/distributed/rank_data_parallel.py, the
methods MultiProcessRunner takes from DataParallelSteps.

    runner = MultiProcessRunner("infc.runtime.distributed.rank_runners:nccl_rank_runner",
                                {"artifact": ..., "model_dir": ..., "num_pages": ...}, world=2)
    engine = Engine(runner, ...)        # the runner interface: execute, page_size, num_pages, ...
    ...
    runner.close()

The worker's runner is pluggable: `factory` names a function "module:function" called in every
rank's process as factory(rank, world, config, link) -> runner (config: the JSON-able dict given
to MultiProcessRunner; link: RankLink, for data rank 0 shares at startup, such as the NCCL id,
and for the CPU exchange). A runner may have close(graceful): graceful when every rank closes
together, False after a failure. Worker processes get only strings and ints (spawn context).

Failures: a worker that dies (its socket closes, its process sentinel fires), raises, or does not
answer within step_timeout makes rank 0's current or next step raise RankError naming the rank
and why; the runner is dead from then on (the server's /health reports the engine's death). A
worker that dies while no step runs (an idle server) is seen by the watchdog at once: the ranks
go down and `on_failure(RankError)` is called (the backend marks the engine dead with it, so
/health fails and `infc serve` exits without waiting for a request). A worker whose rank 0 goes
away exits.
"""
import importlib
import json
import multiprocessing
import os
import secrets
import select
import signal
import socket
import sys
import threading
import time
import traceback

import numpy as np

from infc import envs
from . import step_channel as ch
from ..engine.gc_freeze import freeze_startup
from .rank_data_parallel import DataParallelSteps


class RankError(RuntimeError):
    """A rank's worker process died, failed or stopped answering: the ranks are down."""
    engine_fatal = True


def _load(factory: str):
    module, _, name = factory.partition(":")
    if not name:
        raise ValueError(f"factory {factory!r}: expected 'module:function'")
    return getattr(importlib.import_module(module), name)


# -- links ------------------------------------------------------------------------------------
class RankLink:
    """What a rank's factory sees of the others. share(data): rank 0 passes bytes and every
    worker gets them back (startup only); exchange(): the CPU collectives' transport."""

    def __init__(self, rank: int, world: int, step_socks: dict, coll_socks: dict, timeout: float,
                 watch=None):
        self.rank, self.world, self.timeout = rank, world, timeout
        self.step_socks, self.coll_socks = step_socks, coll_socks   # rank 0: {r: sock}; worker: {0: sock}
        self.watch = watch or {}                                      # rank 0: {r: sentinel}
        self._exchange = None

    def share(self, data: bytes | None = None) -> bytes:
        if self.rank == 0:
            frame = ch.encode(ch.BYTES, [("data", np.frombuffer(bytes(data), np.uint8))])
            for r, s in self.step_socks.items():
                ch.send_frame(s, frame, f"rank {r}")
            return bytes(data)
        kind, items = ch.recv(self.step_socks[0], self.timeout, "rank 0")
        if kind != ch.BYTES:
            raise ch.ChannelError(f"expected shared bytes from rank 0, got {ch.KIND_NAMES[kind]}")
        return dict(items)["data"].tobytes()

    def exchange(self) -> "SocketExchange":
        if self._exchange is None:
            self._exchange = SocketExchange(self)
        return self._exchange


class SocketExchange:
    """The numpy references' `ctx.exchange` across processes: gather(args) sends this rank's
    inputs of a collective launch to rank 0, which returns every rank's (rank order) to all;
    then inputs(i) -> [rank 0's input i, rank 1's, ...] as runtime/reference/ranks.py's
    RankExchange gives them."""

    def __init__(self, link: RankLink):
        self.link, self.world = link, link.world
        self.current: list | None = None

    def inputs(self, i: int) -> list:
        if self.current is None:
            raise RuntimeError("a collective's reference ran outside a collective launch")
        return [args[i] for args in self.current]

    def gather(self, args: list):
        link = self.link
        if link.rank != 0:
            s = link.coll_socks[0]
            ch.send_frame(s, ch.encode(ch.ARRAYS, [(f"{i}", a) for i, a in enumerate(args)]), "rank 0")
            kind, items = ch.recv(s, link.timeout, "rank 0")
            self.current = _unflatten(kind, items, self.world, len(args))
            return
        every = [list(args)]
        for r in range(1, self.world):
            kind, items = ch.recv(link.coll_socks[r], link.timeout, f"rank {r}",
                                  [link.watch[r]] if r in link.watch else ())
            if kind != ch.ARRAYS or len(items) != len(args):
                raise ch.ChannelError(f"rank {r} sent {ch.KIND_NAMES[kind]} with {len(items)} "
                                      f"arrays to a collective of {len(args)} inputs (out of step)")
            every.append([v for _, v in items])
        frame = ch.encode(ch.ARRAYS, [(f"{r}.{i}", a) for r, ra in enumerate(every)
                                      for i, a in enumerate(ra)])
        for r in range(1, self.world):
            ch.send_frame(link.coll_socks[r], frame, f"rank {r}")
        self.current = every


def _unflatten(kind, items, world, n):
    if kind != ch.ARRAYS or len(items) != world * n:
        raise ch.ChannelError(f"rank 0 sent {ch.KIND_NAMES[kind]} with {len(items)} arrays, "
                              f"expected {world} ranks x {n}")
    vals = [v for _, v in items]
    return [vals[r * n:(r + 1) * n] for r in range(world)]


# -- the worker process -----------------------------------------------------------------------
def _connect(host: str, port: int, token: str, rank: int, role: str, timeout: float) -> socket.socket:
    s = socket.create_connection((host, port), timeout=timeout)
    s.settimeout(None)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    ch.send_frame(s, ch.encode(ch.HELLO, [("token", token), ("rank", rank), ("role", role)]), "rank 0")
    return s


def worker_main(host: str, port: int, token: str, rank: int, world: int, factory: str,
                config: str, timeout: float = 600.0):
    """The body of rank `rank`'s process (spawned by MultiProcessRunner; plain arguments only)."""
    step = _connect(host, port, token, rank, "step", timeout)
    coll = _connect(host, port, token, rank, "coll", timeout)
    link = RankLink(rank, world, {0: step}, {0: coll}, timeout)
    runner = None
    stopped = False                    # a STOP from rank 0: every rank closes together
    pending = None                     # (step, handle): a launched data-parallel step, uncollected
    try:
        runner = _load(factory)(rank, world, json.loads(config), link)
        freeze_startup()                # its steps' collections skip what loading made
        ch.send_frame(step, ch.encode(ch.ACK, [("step", -1)] + _shape_of(runner)), "rank 0")
        while True:
            try:
                kind, items = ch.recv(step, None, "rank 0")
            except ch.PeerGone:
                return                                  # rank 0 exited: nothing left to serve
            if pending is not None and kind not in (ch.DP_LAUNCH, ch.DP_COLLECT, ch.FREE, ch.STOP):
                raise ch.ChannelError(f"a {ch.KIND_NAMES[kind]} frame while data-parallel step "
                                      f"{pending[0]} is launched and uncollected")
            if kind == ch.STEP:
                k, meta = ch.meta_of(kind, items)
                runner.execute(meta, [None] * meta.B)   # rank 0 samples; this rank computes
                ch.send_frame(step, ch.encode(ch.ACK, [("step", k)]), "rank 0")
            elif kind == ch.DP_STEP:
                # this rank's own sequences: it samples them itself, rank 0 gets the samples
                k, meta, sampling = ch.dp_step_of(kind, items)
                samples = runner.execute(meta, sampling)
                ch.send_frame(step, ch.encode_samples(k, samples), "rank 0")
            elif kind == ch.DP_LAUNCH:
                # an overlapped data-parallel step: launch it (its fed tokens are this rank's
                # samples of the step launched before), then answer with the samples of that step
                # if rank 0 has not collected it yet (it waits for them), else with none
                k, meta, sampling, feed = ch.dp_launch_of(kind, items)
                handle = runner.launch(meta, sampling, feed)
                if pending is not None:
                    frame = ch.encode_samples(pending[0], runner.collect(pending[1]))
                else:
                    frame = ch.encode(ch.ACK, [("step", k)])
                pending = (k, handle)
                ch.send_frame(step, frame, "rank 0")
            elif kind == ch.DP_COLLECT:
                k = ch.dp_collect_of(kind, items)
                if pending is None or pending[0] != k:
                    raise ch.ChannelError(f"rank 0 collects data-parallel step {k}, this rank has "
                                          f"{'none' if pending is None else pending[0]} launched")
                samples = runner.collect(pending[1])
                pending = None
                ch.send_frame(step, ch.encode_samples(k, samples), "rank 0")
            elif kind == ch.LAUNCH:
                # an overlapped step: this rank samples every row as rank 0 does (the same
                # logits), for the tokens the next step is fed on this rank's device; never read
                k, meta, sampling, feed = ch.launch_of(kind, items)
                runner.launch(meta, sampling, feed)
                ch.send_frame(step, ch.encode(ch.ACK, [("step", k)]), "rank 0")
            elif kind == ch.FREE:
                free = getattr(runner, "free", None)
                for sid in dict(items)["seq_ids"].tolist():
                    if free is not None:
                        free(int(sid))
            elif kind == ch.STOP:
                stopped = True
                return
            else:
                raise ch.ChannelError(f"a worker got a {ch.KIND_NAMES[kind]} frame from rank 0")
    except ch.PeerGone:
        return
    except BaseException:
        msg = traceback.format_exc()
        try:
            ch.send_frame(step, ch.encode(ch.ERROR, [("message", msg)]), "rank 0")
        except Exception:
            pass
        sys.stderr.write(f"infc rank {rank} failed:\n{msg}")
        sys.stderr.flush()
        os._exit(1)
    finally:
        close = getattr(runner, "close", None)
        if close is not None:
            try:
                close(stopped)
            except Exception:
                pass
        step.close()
        coll.close()


def _shape_of(runner) -> list:
    return [(k, int(getattr(runner, k, 0) or 0)) for k in ("num_pages", "page_size", "num_slots",
                                                           "vocab_size")]


# -- rank 0 -----------------------------------------------------------------------------------
def _why(exitcode) -> str:
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


class MultiProcessRunner(DataParallelSteps):
    """The engine's runner on rank 0 over `world` ranks, ranks 1.. in spawned processes."""

    def __init__(self, factory: str, config: dict, world: int, step_timeout: float = 300.0,
                 startup_timeout: float = 900.0, host: str = "127.0.0.1"):
        if world < 1:
            raise ValueError(f"world must be >= 1, got {world}")
        self.world, self.step_timeout = world, step_timeout
        self.error: RankError | None = None
        self.procs: dict = {}
        self.step_socks: dict = {}
        self.coll_socks: dict = {}
        self.runner = None
        self._step, self._acked = 0, -1
        self._said: dict[int, str] = {}           # rank -> the traceback its worker sent
        self._in_step: float | None = None         # when rank 0's current step began
        self._aborted: str | None = None           # why the watchdog aborted rank 0's runner
        self._busy = threading.Lock()              # held by a step (or a free) on rank 0
        self._init_data_parallel()
        self.on_failure = None                     # on_failure(RankError): a death seen while idle
        cfg = json.dumps(config)
        token = secrets.token_hex(16)
        self._listener = socket.create_server((host, 0))
        port = self._listener.getsockname()[1]
        spawn = multiprocessing.get_context("spawn")
        try:
            for r in range(1, world):
                p = spawn.Process(target=worker_main, name=f"infc-rank{r}", daemon=True,
                                  args=(host, port, token, r, world, factory, cfg, startup_timeout))
                p.start()
                self.procs[r] = p
            self._accept(token, startup_timeout)
            self.link = RankLink(0, world, self.step_socks, self.coll_socks, step_timeout,
                                 {r: p.sentinel for r, p in self.procs.items()})
            self.runner = _load(factory)(0, world, config, self.link)
            mine = dict(_shape_of(self.runner))
            for r in self.procs:
                kind, items = self._recv(r, startup_timeout)
                if kind != ch.ACK:
                    raise ch.ChannelError(f"rank {r} answered its startup with {ch.KIND_NAMES[kind]}")
                theirs = {k: v for k, v in items if k != "step"}
                if theirs != mine:
                    raise RankError(f"rank {r}'s runner has {theirs}, rank 0's has {mine}: every "
                                    f"rank needs the same pages and slots (give num_pages)")
        except BaseException as e:
            err = self._down(e)
            raise err from e
        r0 = self.runner
        self.plan = getattr(r0, "plan", None)
        self.page_size, self.num_pages = r0.page_size, r0.num_pages
        self.vocab_size = getattr(r0, "vocab_size", None)
        self.num_slots = getattr(r0, "num_slots", 0)
        for k in ("max_seqs", "buckets", "sampler"):
            if hasattr(r0, k):
                setattr(self, k, getattr(r0, k))
        self._watchdog = threading.Thread(target=self._watch, name="infc-rank-watchdog", daemon=True)
        self._watchdog.start()

    def _watch(self):
        """While a step runs, a worker's death or a step past step_timeout aborts rank 0's runner
        (runner.abort: NCCL's ncclCommAbort on the GPUs), so a collective waiting for a dead rank
        returns an error instead of hanging; the next socket wait or step reports which rank."""
        sentinels = {p.sentinel: r for r, p in self.procs.items()}
        while self.error is None:
            fired, _, _ = select.select(list(sentinels), [], [], 0.1) if sentinels else ([], 0, 0)
            if not sentinels:
                time.sleep(0.1)
            since = self._in_step
            dead = [sentinels.pop(f) for f in fired]      # seen once; a step path reports it
            if dead and since is None and self._idle_death(dead):
                return
            reason = None
            if since is not None and (fired or not all(p.exitcode is None for p in self.procs.values())):
                reason = "a worker died during the step"
            elif since is not None and time.monotonic() - since > self.step_timeout:
                reason = f"the step ran past step_timeout ({self.step_timeout:.0f} s)"
            if reason and self._aborted is None:
                abort = getattr(self.runner, "abort", None)
                if abort is None:
                    continue                        # the CPU exchange's socket waits time out
                self._aborted = reason
                try:
                    abort()
                except Exception:
                    pass

    def _idle_death(self, ranks: list[int]) -> bool:
        """A worker died while no step ran: take the ranks down now and say so (on_failure), so
        an idle server does not answer /health 200 over a dead rank. False when a step holds the
        runner (that step reports the death) or the ranks are down already."""
        if not self._busy.acquire(blocking=False):
            return False
        try:
            if self.error is not None:
                return True
            who = ", ".join(f"rank {r} (pid {self.procs[r].pid})" for r in ranks)
            err = self._down(ch.PeerGone(f"{who} exited while the ranks were idle"))
        finally:
            self._busy.release()
        if self.on_failure is not None:
            try:
                self.on_failure(err)
            except Exception:
                pass
        return True

    # -- startup ------------------------------------------------------------------------------
    def _accept(self, token: str, timeout: float):
        deadline = time.monotonic() + timeout
        want = {(r, role) for r in self.procs for role in ("step", "coll")}
        while want:
            left = deadline - time.monotonic()
            dead = [r for r, p in self.procs.items() if p.exitcode is not None]
            if dead:
                raise RankError(f"rank {dead[0]} exited while starting ({_why(self.procs[dead[0]].exitcode)})")
            if left <= 0:
                raise RankError(f"ranks {sorted({r for r, _ in want})} did not connect within {timeout:.0f} s")
            ready, _, _ = select.select([self._listener], [], [], min(left, 0.5))
            if not ready:
                continue
            s, _ = self._listener.accept()
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                kind, items = ch.recv(s, 10.0, "a connecting worker")
                d = dict(items)
                key = (d.get("rank"), d.get("role"))
                if kind != ch.HELLO or d.get("token") != token or key not in want:
                    raise ch.ChannelError("not one of this runner's workers")
            except (ch.ChannelError, ch.PeerGone):
                s.close()                                   # a stranger on the port: ignored
                continue
            (self.step_socks if key[1] == "step" else self.coll_socks)[key[0]] = s
            want.discard(key)

    # -- steps --------------------------------------------------------------------------------
    def _recv(self, r: int, timeout: float):
        kind, items = ch.recv(self.step_socks[r], timeout, f"rank {r}", [self.procs[r].sentinel])
        if kind == ch.ERROR:
            self._said[r] = dict(items)["message"]
            raise RankError(f"rank {r} failed:\n{self._said[r]}")
        return kind, items

    def _check_alive(self):
        """Raise PeerGone if a worker has exited (RankError if the ranks are down already)."""
        if self.error is not None:
            raise RankError(f"the ranks are down: {self.error}")
        sentinels = {p.sentinel: r for r, p in self.procs.items()}
        fired, _, _ = select.select(list(sentinels), [], [], 0) if sentinels else ([], 0, 0)
        if fired:
            r = sentinels[fired[0]]
            raise ch.PeerGone(f"rank {r} exited")

    def _acks(self):
        """The previous step's acknowledgement from every worker (a worker that raised sends its
        traceback instead)."""
        if self._acked == self._step - 1:
            return
        for r in self.procs:
            kind, items = self._recv(r, self.step_timeout)
            k = dict(items).get("step")
            if kind != ch.ACK or k != self._step - 1:
                raise ch.ChannelError(f"rank {r} answered {ch.KIND_NAMES[kind]} {k}, expected the "
                                      f"ack of step {self._step - 1}")
        self._acked = self._step - 1

    def _run(self, meta, fn, frame=None):
        """Send the step to the workers, then fn() on rank 0's runner. frame(step index) -> the
        frame the workers get (default: the STEP frame of meta)."""
        def step():
            self._check_alive()
            self._acks()
            f = frame(self._step) if frame is not None else ch.encode_step(meta, self._step)
            for r, s in self.step_socks.items():
                ch.send_frame(s, f, f"rank {r}")
            self._step += 1
            return fn()
        with self._busy:
            self._refuse_in_flight()
            return self._guarded(step)

    def _refuse_in_flight(self):
        """A shared or synchronous step while an overlapped data-parallel step is uncollected is
        a caller's error: refused before any rank sees it (the ranks stay up)."""
        if self._dp_flight and self.error is None:
            raise RuntimeError(f"data-parallel step {self._dp_flight[0].step} was launched by "
                               f"launch_ranks and is not collected: collect_ranks it before "
                               f"running another kind of step")

    def _guarded(self, fn):
        """fn() as a step as far as the watchdog is concerned (a worker that dies meanwhile aborts
        rank 0's wait: a collective would wait forever); any failure takes the ranks down."""
        if self.error is not None:
            raise RankError(f"the ranks are down: {self.error}")
        self._in_step = time.monotonic()
        try:
            out = fn()
            if self._aborted:
                raise RankError(f"rank 0's runner was aborted: {self._aborted}")
            return out
        except BaseException as e:
            raise self._down(e) from None
        finally:
            self._in_step = None

    def execute(self, meta, sampling):
        return self._run(meta, lambda: self.runner.execute(meta, sampling))

    # -- overlapped steps (engine.Engine) --------------------------------------------------------
    @property
    def can_overlap(self) -> bool:
        """A rank runner with launch / collect that does not compute at launch (a GPU's; the CPU's
        would only hand its tokens out a step later), unless INFC_RANK_OVERLAP=0;
        INFC_RANK_OVERLAP=1 overlaps any rank runner (tests of the frames). Every rank then samples
        each row as rank 0 does (a LAUNCH frame carries the rows; the ranks' logits are the same
        bits), so that each can feed the next step's pending tokens on its own device. The same
        rule holds for data-parallel ranks (launch_ranks / collect_ranks), where each rank
        samples and feeds its own rows."""
        from ..engine.runner import ComputedAtLaunch
        setting = envs.value("INFC_RANK_OVERLAP")
        if setting == "0" or not callable(getattr(self.runner, "launch", None)):
            return False
        return setting == "1" or not isinstance(self.runner, ComputedAtLaunch)

    def launch(self, meta, sampling, feed=()):
        return self._run(meta, lambda: self.runner.launch(meta, sampling, feed),
                         lambda k: ch.encode_launch(meta, k, sampling, feed))

    def collect(self, handle):
        """Rank 0's samples of a launched step, its wait guarded as a step's."""
        with self._busy:
            return self._guarded(lambda: self.runner.collect(handle))

    def logits(self, meta):
        """Run a step; rank 0's logits (runners that have `logits`)."""
        return self._run(meta, lambda: self.runner.logits(meta))

    # -- frees ------------------------------------------------------------------------------------
    def free(self, seq_id: int):
        """Forward a sequence's free to every rank (runners that keep per-sequence state)."""
        with self._busy:
            self._free_locked(seq_id, range(self.world))

    def free_on(self, rank: int, seq_id: int):
        """Free a sequence on the one rank that runs it (data-parallel ranks: each its own
        sequences, their ids not shared)."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} of {self.world}")
        with self._busy:
            self._free_locked(seq_id, [rank])

    def _free_locked(self, seq_id: int, ranks):
        if self.error is not None:
            raise RankError(f"the ranks are down: {self.error}")
        frame = ch.encode(ch.FREE, [("seq_ids", np.asarray([seq_id], np.int64))])
        try:
            self._check_alive()
            for r in ranks:
                if r != 0:
                    ch.send_frame(self.step_socks[r], frame, f"rank {r}")
        except BaseException as e:
            raise self._down(e) from None
        free = getattr(self.runner, "free", None)
        if free is not None and 0 in ranks:
            free(seq_id)

    # -- failure and shutdown -----------------------------------------------------------------
    def _down(self, cause: BaseException) -> RankError:
        """Turn a failure into one RankError naming each rank's state; stop every worker."""
        if self.error is not None:
            return self.error
        time.sleep(0.05)                 # a dying worker's exit code and last frame settle
        notes = []
        for r, p in self.procs.items():
            if p.exitcode is None and select.select([p.sentinel], [], [], 0)[0]:
                p.join(5)                # exited (its pipes closed); a GPU process takes a while to be reaped
            said = self._said.get(r, "").strip().splitlines()[-1:]
            said = said[0] if said else ""
            s = self.step_socks.get(r)
            if s is not None and not said:
                try:
                    while True:          # drain acks; keep an error frame's traceback
                        kind, items = ch.recv(s, 0.05, f"rank {r}")
                        if kind == ch.ERROR:
                            said = dict(items)["message"].strip().splitlines()[-1]
                            break
                except Exception:
                    pass
            if p.exitcode is not None or said:
                notes.append(f"rank {r} (pid {p.pid}) {'failed: ' + said if said else 'died'}"
                             f" ({_why(p.exitcode)})")
        if self._aborted:
            notes.append(f"rank 0's step aborted: {self._aborted}")
        if isinstance(cause, RankError) and not notes:
            msg = str(cause)
        else:
            msg = "; ".join(notes) if notes else f"{cause.__class__.__name__}: {cause}"
        self.error = RankError(f"multi-process ranks: {msg}")
        self._stop_workers(graceful=False)
        return self.error

    def _send_stop(self):
        frame = ch.encode(ch.STOP, [])
        for r, s in self.step_socks.items():
            try:
                ch.send_frame(s, frame, f"rank {r}")
            except ch.PeerGone:
                pass

    def _stop_workers(self, graceful: bool = True, timeout: float = 10.0):
        """graceful: wait up to `timeout` s for the workers (told to stop) to exit; then kill."""
        deadline = time.monotonic() + (timeout if graceful else 0)
        for p in self.procs.values():
            p.join(max(0.0, deadline - time.monotonic()))
            if p.exitcode is None:
                p.kill()
                p.join(5)
        for s in (*self.step_socks.values(), *self.coll_socks.values(), self._listener):
            try:
                s.close()
            except OSError:
                pass

    def close(self):
        """Stop the workers (after their last step) and close rank 0's runner. A graceful close
        tells the workers to stop, closes rank 0's runner meanwhile (every rank releases its
        communicator at once: ncclCommDestroy), then waits for them; after a failure rank 0's
        communicator is aborted."""
        if self.error is None:
            try:
                while self._dp_flight:          # launched data-parallel steps: finish them first
                    self.collect_ranks(self._dp_flight[0])
                self._acks()
            except BaseException as e:
                self._down(e)
        graceful = self.error is None
        if graceful:
            self.error = RankError("closed")
            self._send_stop()
        close = getattr(self.runner, "close", None)
        if close is not None:
            close(graceful)
        if graceful:
            self._stop_workers(graceful=True)
