"""KV events (vLLM's --kv-events-config; issue 44): the prefix cache's blocks stored, removed and
cleared, published over ZeroMQ for KV-aware routers (docs/serving.md, "KV events").

The block manager records events as plain tuples in `bm.events` (a list, or None when events are
off: nothing is recorded) while a step runs:

    ("stored", [hash, ...], parent hash | None, token ids, lora (name, id) | None, medium)
    ("removed", [hash, ...], medium)
    ("cleared",)

and the engine hands each rank's list to its Publisher at the end of the step. The step's cost is
those appends and one put_nowait; converting the hashes, encoding (kv_event_wire.py) and sending
run on the publisher's thread. A full queue drops the batch and counts it (`stats.dropped_*`,
/metrics infc:kv_events_dropped_total): the engine never waits for a subscriber, and a failure
inside the thread is counted and logged, never raised into the engine.

On the wire (vLLM's ZmqEventPublisher, as its subscribers expect): a PUB socket sends each batch
as the multipart message [topic, sequence number (8 bytes big-endian, from 0), payload]; the PUB
socket binds when the endpoint has a wildcard (`*`, `::`) or is ipc:// or inproc://, else it
connects (to a router that binds). With a replay endpoint, a ROUTER socket keeps the last
buffer_steps batches: a request [start sequence (8 bytes big-endian)] (from a REQ socket, or a
DEALER sending an empty frame first) is answered with [sequence, payload] for every kept batch
from start on, then [-1 (8 bytes, signed), b""].

Data-parallel ranks publish each on its own sockets, as vLLM's ranks do: a tcp endpoint's port
plus the rank (rank 0 keeps it), an ipc / inproc one with `_dp<rank>` appended; every batch
carries its data_parallel_rank.
"""
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

# vLLM's medium names: the device's pages ("GPU" on either device: the routers weigh it as the
# primary tier) and the host tier
MEDIUM_DEVICE = "GPU"
MEDIUM_HOST = "CPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_POLL_S = 0.05              # the thread's idle wake-up: a replay request waits at most this long
_CLOSE_S = 1.0


@dataclass
class PublisherStats:
    rank: int = 0
    queued_batches: int = 0         # handed over by the engine (the rest were dropped)
    published_batches: int = 0
    dropped_batches: int = 0        # the queue was full: the step did not wait
    dropped_events: int = 0
    errors: int = 0                 # encoding or sending failed inside the thread
    replays: int = 0


def rank_endpoint(endpoint: str | None, rank: int) -> str | None:
    """A data-parallel rank's own address for `endpoint` (see above)."""
    if endpoint is None or rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        if not port.isdigit() or base == "tcp":
            raise ValueError(f"--kv-events-config: endpoint {endpoint!r} has no port to offset for "
                             f"data-parallel rank {rank}")
        return f"{base}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class Publisher:
    """One rank's stream: its sockets live on its own thread (a ZeroMQ socket is used by one
    thread). The constructor returns once they are bound or connected, or raises ValueError
    naming the address that failed."""

    def __init__(self, config, rank: int, block_size: int, log=None):
        self.block_size, self.log = block_size, log
        self.endpoint = rank_endpoint(config.endpoint, rank)
        self.replay_endpoint = rank_endpoint(config.replay_endpoint, rank)
        self.topic = config.topic.encode()
        self.hwm, self.buffer_steps = config.hwm, config.buffer_steps
        self.stats = PublisherStats(rank)
        self.queue: queue.Queue = queue.Queue(config.max_queue_size)
        self._error: Exception | None = None
        self._ready = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=f"infc-kv-events-{rank}", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise ValueError(f"--kv-events-config: {self._error}") from None

    # -- the engine's side ------------------------------------------------------------------------
    def publish(self, events: list):
        """Queue a step's events (never blocks: a full queue drops them, counted)."""
        if not events:
            return
        try:
            self.queue.put_nowait((time.time(), events))
            self.stats.queued_batches += 1
        except queue.Full:
            self.stats.dropped_batches += 1
            self.stats.dropped_events += len(events)

    def close(self, timeout: float = _CLOSE_S):
        """Send what is queued (within timeout), then close the sockets."""
        try:
            self.queue.put(None, timeout=timeout)
        except queue.Full:
            self._stop = True
        self._thread.join(timeout)
        self._stop = True

    # -- the thread ---------------------------------------------------------------------------------
    def _sockets(self, zmq):
        ctx = zmq.Context.instance()
        pub = ctx.socket(zmq.PUB)
        replay = None
        try:
            pub.setsockopt(zmq.SNDHWM, self.hwm)
            pub.setsockopt(zmq.LINGER, int(_CLOSE_S * 1000))
            what = self.endpoint
            (pub.bind if _binds(self.endpoint) else pub.connect)(self.endpoint)
            if self.replay_endpoint is not None:
                what = self.replay_endpoint
                replay = ctx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, 0)
                replay.bind(self.replay_endpoint)
        except zmq.ZMQError as e:
            pub.close(0)
            if replay is not None:
                replay.close(0)
            raise ValueError(f"cannot open {what!r}: {e}") from None
        return pub, replay

    def _run(self):
        try:
            import zmq
            from . import kv_event_wire as wire
            pub, replay = self._sockets(zmq)
        except Exception as e:                  # noqa: BLE001 - reported by the constructor
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        kept: deque = deque(maxlen=self.buffer_steps)
        seq = 0
        try:
            while not self._stop:
                if replay is not None and replay.poll(0):
                    self._guarded(self._replay, replay, kept)
                try:
                    item = self.queue.get(timeout=_POLL_S)
                except queue.Empty:
                    continue
                if item is None:
                    break
                ts, events = item
                try:
                    payload = wire.encode(ts, events, self.block_size, self.stats.rank)
                    pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
                except Exception as e:          # noqa: BLE001 - counted; the stream goes on
                    self._failed(e)
                    continue
                kept.append((seq, payload))
                seq += 1
                self.stats.published_batches += 1
        finally:
            pub.close()
            if replay is not None:
                replay.close()

    def _replay(self, replay, kept: deque):
        frames = replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:     # [identity, b"", start]: else not ours
            self._failed(ValueError(f"a replay request of {len(frames)} frames, not "
                                    "[identity, empty, 8-byte start]"))
            return
        who, start = frames[0], int.from_bytes(frames[2], "big")
        self.stats.replays += 1
        for s, payload in list(kept):
            if s >= start:
                replay.send_multipart((who, b"", s.to_bytes(8, "big"), payload))
        replay.send_multipart((who, b"", END_SEQ, b""))

    def _guarded(self, fn, *args):
        try:
            fn(*args)
        except Exception as e:                  # noqa: BLE001 - counted; the stream goes on
            self._failed(e)

    def _failed(self, e: Exception):
        self.stats.errors += 1
        if self.log and self.stats.errors == 1:
            self.log(f"  KV events (rank {self.stats.rank}): {type(e).__name__}: {e} (further errors "
                     f"counted, not logged)")


def for_engine(config, dp: int, block_size: int, prefix_caching: bool, log=None) -> list | None:
    """The engine's publishers, one a data-parallel rank, or None (off, or nothing to publish:
    a note)."""
    if config is None or not config.enabled:
        return None
    if not prefix_caching:
        if log:
            log("  KV events off: they describe prefix-cache blocks, and prefix caching is off "
                "(for this model, or by --no-enable-prefix-caching)")
        return None
    pubs = []
    try:
        for rank in range(dp):
            pubs.append(Publisher(config, rank, block_size, log))
    except ValueError:
        for p in pubs:
            p.close(0)
        raise
    if log:
        replay = f", replay {pubs[0].replay_endpoint}" if pubs[0].replay_endpoint else ""
        ranks = f" (+ {dp - 1} data-parallel ranks)" if dp > 1 else ""
        log(f"  KV events: {'bound' if _binds(pubs[0].endpoint) else 'connected'} "
            f"{pubs[0].endpoint}{replay}{ranks}, topic {config.topic!r}")
    return pubs
