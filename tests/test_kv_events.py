"""KV events (--kv-events-config; runtime/engine/kv_events.py, issue 44): the prefix cache's blocks
stored, removed and cleared, published over ZeroMQ in vLLM's format for KV-aware routers.

A subscriber decodes the stream with the router side's schema (below: msgspec structs, positional
with the class name first, as vLLM's subscribers and llm-d's indexer read them) and keeps the
router's index of each replica's blocks: after the engine ran prompts with shared prefixes under
memory pressure the index holds exactly the blocks the block manager caches, every stored hash is
the one the block's tokens and parent chain name, evictions arrive as BlockRemoved and a reset as
AllBlocksCleared. Gaps are filled through the replay socket, as a router does. A full queue drops
batches (counted) without the engine waiting; data-parallel ranks publish on their own ports with
their rank; a malformed config is refused by name; and `infc serve --device cpu` publishes the
blocks of a request's prompt."""
import hashlib
import json
import threading
import time
import uuid

import msgspec
import numpy as np
import pytest
import zmq

from infc.cli import parser
from infc.config import kv_events_config
from infc.runtime.engine import kv_event_wire, kv_events
from infc.runtime.engine.runner import Sample
from infc.runtime.engine.sampling import SamplingParams
from infc.server.args import config_from_args
from test_scheduler import FakeRunner, drain, make_engine
from test_server_support import one_blas_thread, request, serve_process  # noqa: F401

GREEDY = dict(temperature=0, ignore_eos=True)


# -- the router side's schema (vLLM's subscriber structs; llm-d reads the same positions) -------
class EventBatch(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, tag=True, forbid_unknown_fields=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODE = msgspec.msgpack.Decoder(KVEventBatch)
U64 = 1 << 64


class Router:
    """A subscriber as a KV-aware router runs one: SUB on the endpoint, a DEALER on the replay
    socket to fill gaps (sequence numbers are consecutive from 0), and the index of the blocks the
    replica holds: hash -> (parent, tokens)."""

    def __init__(self, endpoint: str, replay: str, topic: str = ""):
        ctx = zmq.Context.instance()
        self.sub = ctx.socket(zmq.SUB)
        self.sub.connect(endpoint)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.replay = ctx.socket(zmq.DEALER)
        self.replay.connect(replay)
        self.topic = topic.encode()
        self.next = 0
        self.batches: list[KVEventBatch] = []
        self.media: dict[str, dict] = {}       # medium -> hash -> (parent, tokens)
        self.seen: dict[int, tuple] = {}       # every device block ever stored, removed ones too
        self.removed, self.cleared = [], 0     # removed: (medium, hash)

    @property
    def index(self) -> dict:
        return self.media.get("GPU", {})

    def close(self):
        self.sub.close(0)
        self.replay.close(0)

    def ask_replay(self, start: int) -> list[tuple[int, bytes]]:
        self.replay.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            assert self.replay.poll(5000), "no replay answer"
            empty, seq, payload = self.replay.recv_multipart()
            assert empty == b""
            seq = int.from_bytes(seq, "big", signed=True)
            if seq == -1:
                assert payload == b""
                return out
            out.append((seq, payload))

    def take(self, seq: int, payload: bytes):
        if seq < self.next:
            return                             # had it already (from a replay)
        if seq > self.next:                    # missed some (a slow joiner): replay them
            for s, p in self.ask_replay(self.next):
                if s < seq:
                    self.take(s, p)
        assert seq == self.next, (seq, self.next)
        self.next += 1
        batch = DECODE.decode(payload)
        self.batches.append(batch)
        for ev in batch.events:
            self.apply(ev)

    def apply(self, ev):
        if isinstance(ev, BlockStored):
            index = self.media.setdefault(ev.medium, {})
            n = ev.block_size
            if not ev.token_ids:               # a tier's block: its hash alone (as vLLM's CPU offloading)
                assert ev.medium != "GPU" and ev.parent_block_hash is None
                index.update(dict.fromkeys(ev.block_hashes))
                return
            assert len(ev.token_ids) == n * len(ev.block_hashes)
            parent = ev.parent_block_hash
            for i, h in enumerate(ev.block_hashes):
                assert 0 <= h < U64
                index[h] = self.seen[h] = (parent, ev.token_ids[i * n:(i + 1) * n])
                parent = h
        elif isinstance(ev, BlockRemoved):
            index = self.media.get(ev.medium, {})
            for h in ev.block_hashes:
                assert h in index, f"removed a {ev.medium} block never stored"
                del index[h]
                self.removed.append((ev.medium, h))
        else:
            self.media.clear()
            self.cleared += 1

    def sync(self, pubs, timeout=5.0):
        """Read the stream up to every batch the engine has handed its publisher."""
        (pub,) = pubs
        t0 = time.monotonic()
        while pub.stats.published_batches + pub.stats.errors < pub.stats.queued_batches:
            assert time.monotonic() - t0 < timeout, pub.stats
            time.sleep(0.002)
        assert pub.stats.errors == 0, pub.stats
        while self.next < pub.stats.published_batches:
            if self.sub.poll(50):
                topic, seq, payload = self.sub.recv_multipart()
                assert topic == self.topic
                self.take(int.from_bytes(seq, "big"), payload)
            else:                              # nothing live: the rest by replay
                for s, p in self.ask_replay(self.next):
                    self.take(s, p)
            assert time.monotonic() - t0 < timeout

    def prefix(self, h: int) -> list[int]:
        """The tokens the block h closes, from the first: its parent chain's."""
        out, walked = [], set()
        while h is not None:
            assert h not in walked, "a parent chain that loops"
            walked.add(h)
            parent, tokens = self.seen[h]
            out[:0] = tokens
            h = parent
        return out


def wire_hash(tokens) -> int:
    return int.from_bytes(hashlib.sha256(np.asarray(tokens, np.int64).tobytes()).digest()[-8:], "big")


def addresses(topic: str = "kv@pod-0@tiny", **over) -> tuple:
    name = uuid.uuid4().hex
    cfg = dict(enable_kv_cache_events=True, endpoint=f"inproc://ev-{name}",
               replay_endpoint=f"inproc://replay-{name}", topic=topic, **over)
    return kv_events_config(cfg), cfg


def cached_wire_hashes(engine) -> set[int]:
    return {kv_event_wire.block_hash(h) for h in engine.bm.cached}


# -- through the engine on the CPU -------------------------------------------------------------
def test_the_router_index_mirrors_the_prefix_cache():
    config, _ = addresses()
    e = make_engine(FakeRunner(12, 4), kv_events_config=config, max_num_seqs=4)
    router = Router(config.endpoint, config.replay_endpoint, config.topic)
    try:
        rng = np.random.default_rng(0)
        shared = rng.integers(1, 90, 9).tolist()
        for round_ in range(3):                # 2 x 8 pages a round into 12: later rounds evict
            for i in range(2):
                prompt = shared + rng.integers(1, 90, int(rng.integers(12, 20))).tolist()
                e.add_request(prompt, SamplingParams(max_tokens=5, **GREEDY))
            drain(e)
            router.sync(e.kv_events)
            assert router.index.keys() == cached_wire_hashes(e), round_
        for h in router.index:                 # each hash is its block's tokens and parents'
            assert h == wire_hash(router.prefix(h))
        removed = {h for m, h in router.removed if m == "GPU"}
        assert removed and not removed & cached_wire_hashes(e) and set(router.media) == {"GPU"}
        stored = [ev for b in router.batches for ev in b.events if isinstance(ev, BlockStored)]
        assert {(ev.block_size, ev.medium, ev.lora_id, ev.lora_name) for ev in stored} == {(4, "GPU", None, None)}
        assert any(ev.parent_block_hash is not None for ev in stored)   # a prefix hit's suffix
        assert {b.data_parallel_rank for b in router.batches} == {0}

        e.reset_prefix_cache()                 # every block forgotten: AllBlocksCleared
        router.sync(e.kv_events)
        assert router.cleared == 1 and not router.index and not e.bm.cached
        assert isinstance(router.batches[-1].events[-1], AllBlocksCleared)
        e.bm.check()
    finally:
        router.close()
        e.close()


def test_host_tier_blocks_are_reported_with_their_medium():
    """With --kv-offloading-size, blocks entering and leaving the host pool are "CPU" events; a
    block restored from it is "GPU" BlockStored again, with its tokens and parent."""
    from test_kv_tier import TieredFake, _blocks_gib, _shared_prefix_prompts, _serve
    from infc.runtime.engine.kv_tier.tiers import OffloadConfig
    config, _ = addresses()
    e = make_engine(TieredFake(12), kv_offloading=OffloadConfig(_blocks_gib(14)), kv_events_config=config)
    router = Router(config.endpoint, config.replay_endpoint, config.topic)
    try:
        prompts = _shared_prefix_prompts(np.random.default_rng(5), 16, stems=3)
        _serve(e, prompts, SamplingParams(max_tokens=3, **GREEDY), per_wave=3)
        router.sync(e.kv_events)
        assert router.index.keys() == cached_wire_hashes(e)
        host = {kv_event_wire.block_hash(h) for h in e.tiers.pool.lru}
        assert host and router.media["CPU"].keys() == host
        assert any(m == "CPU" for m, _ in router.removed)        # the pool's LRU evicted some
        assert e.tiers.stats.host_hit_tokens > 0                  # restored blocks: stored again,
        for h in router.index:                                    # their chains intact
            assert h == wire_hash(router.prefix(h))
    finally:
        router.close()
        e.close()


def test_replay_answers_from_the_asked_sequence_and_survives_a_bad_request():
    config, _ = addresses(topic="")
    e = make_engine(FakeRunner(16, 4), kv_events_config=config)
    router = Router(config.endpoint, config.replay_endpoint)
    try:
        for k in range(3):
            e.add_request(list(range(10 * k + 1, 10 * k + 10)), SamplingParams(max_tokens=2, **GREEDY))
            drain(e)
        router.sync(e.kv_events)
        n = e.kv_events[0].stats.published_batches
        assert n >= 3
        router.replay.send_multipart([b"", b"junk"])            # not an 8-byte start: ignored
        got = router.ask_replay(1)
        assert [s for s, _ in got] == list(range(1, n))
        assert [DECODE.decode(p) for _, p in got] == router.batches[1:]
        assert router.ask_replay(n + 5) == []
        assert e.kv_events[0].stats.errors == 1                  # the junk request, counted
    finally:
        router.close()
        e.close()


def test_a_full_queue_drops_counted_and_never_blocks_the_engine(monkeypatch):
    config, _ = addresses(max_queue_size=2)
    release, entered = threading.Event(), threading.Event()
    encode = kv_event_wire.encode

    def slow(*a):                              # a subscriber-side stall: the thread is stuck
        entered.set()
        release.wait(5)
        return encode(*a)
    monkeypatch.setattr(kv_event_wire, "encode", slow)
    pub = kv_events.Publisher(config, 0, 4)
    router = Router(pub.endpoint, pub.replay_endpoint, config.topic)
    try:
        pub.publish([("cleared",)])
        assert entered.wait(5)                 # the thread holds the first batch
        t0 = time.perf_counter()
        for _ in range(5):                     # 2 queued, 3 dropped
            pub.publish([("cleared",), ("cleared",)])
        assert time.perf_counter() - t0 < 0.05
        assert (pub.stats.dropped_batches, pub.stats.dropped_events, pub.stats.queued_batches) == (3, 6, 3)
        release.set()
        router.sync([pub])
        assert [len(b.events) for b in router.batches] == [1, 2, 2]
    finally:
        release.set()
        router.close()
        pub.close()


def test_data_parallel_ranks_publish_on_their_own_ports():
    assert kv_events.rank_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert kv_events.rank_endpoint("tcp://*:5557", 3) == "tcp://*:5560"
    assert kv_events.rank_endpoint("tcp://router.example:7000", 1) == "tcp://router.example:7001"
    assert kv_events.rank_endpoint("inproc://kv", 1) == "inproc://kv_dp1"
    with pytest.raises(ValueError, match="no port to offset for data-parallel rank 2"):
        kv_events.rank_endpoint("tcp://*", 2)
    config, _ = addresses()
    pub = kv_events.Publisher(config, 1, 4)
    router = Router(config.endpoint + "_dp1", config.replay_endpoint + "_dp1", config.topic)
    try:
        tokens = list(np.arange(1, 5))         # numpy integers, as a runner may leave them
        pub.publish([("stored", [b"\x01" * 32], None, tokens, ("ad", 7), "GPU")])
        router.sync([pub])
        (batch,) = router.batches
        assert batch.data_parallel_rank == 1
        assert batch.events == [BlockStored([0x0101010101010101], None, [1, 2, 3, 4], 4, 7, "GPU", "ad")]
    finally:
        router.close()
        pub.close()


class TwoRanks:
    """Two data-parallel ranks that compute nothing (every sampling row gets token 1)."""
    dp_world, num_pages, page_size, vocab_size = 2, 64, 4, 97

    def execute_ranks(self, metas, sampling):
        return [[None if s is None else Sample(1) for s in rows] for rows in sampling]


def test_an_engine_over_two_data_parallel_ranks_publishes_each_ranks_cache():
    config, _ = addresses()
    e = make_engine(TwoRanks(), kv_events_config=config, overlap=False)
    routers = [Router(config.endpoint, config.replay_endpoint, config.topic),
               Router(config.endpoint + "_dp1", config.replay_endpoint + "_dp1", config.topic)]
    try:
        for i in range(4):                     # placed by load: both ranks get some
            e.add_request([1 + (7 * i + j) % 90 for j in range(10 + 6 * i)], SamplingParams(max_tokens=2, **GREEDY))
        drain(e)
        for rank, (router, bm, pub) in enumerate(zip(routers, e.bms, e.kv_events)):
            router.sync([pub])
            assert bm.cached and router.index.keys() == {kv_event_wire.block_hash(h) for h in bm.cached}
            assert {b.data_parallel_rank for b in router.batches} == {rank}
    finally:
        for r in routers:
            r.close()
        e.close()


# -- configuration -------------------------------------------------------------------------------
@pytest.mark.parametrize("value,message", [
    ("{enable_kv_cache_events: true}", r"--kv-events-config is not valid JSON"),
    ("[true]", r"must be a JSON object, got list"),
    ('{"enable_kv_cache_events": true, "port": 5557}', r"unknown key 'port'"),
    ('{"enable_kv_cache_events": "yes"}', r"'enable_kv_cache_events' must be true or false"),
    ('{"enable_kv_cache_events": true, "publisher": "nats"}', r"'publisher' must be one of null, zmq"),
    ('{"enable_kv_cache_events": true, "endpoint": "localhost:5557"}', r"'endpoint' must be a ZeroMQ address"),
    ('{"enable_kv_cache_events": true, "replay_endpoint": 5558}', r"'replay_endpoint' must be a ZeroMQ address"),
    ('{"enable_kv_cache_events": true, "buffer_steps": 0}', r"'buffer_steps' must be an integer >= 1, got 0"),
    ('{"enable_kv_cache_events": true, "hwm": -1}', r"'hwm' must be an integer >= 0, got -1"),
    ('{"enable_kv_cache_events": true, "topic": 3}', r"'topic' must be a string"),
])
def test_malformed_configs_are_refused_by_name(value, message):
    with pytest.raises(ValueError, match=message):
        kv_events_config(value)
    args = parser().parse_args(["serve", "--model-path", "/m", "--kv-events-config", value])
    with pytest.raises(ValueError, match=message):
        config_from_args(args)


def test_defaults_and_an_address_in_use():
    c = kv_events_config('{"enable_kv_cache_events": true}')
    assert (c.publisher, c.endpoint, c.replay_endpoint, c.buffer_steps, c.hwm, c.topic) == \
        ("zmq", "tcp://*:5557", None, 10_000, 100_000, "")
    assert not kv_events_config('{"publisher": "zmq"}').enabled         # vLLM: off unless enabled
    assert not kv_events_config('{"enable_kv_cache_events": true, "publisher": "null"}').enabled
    config, _ = addresses()
    first = kv_events.Publisher(config, 0, 4)
    try:
        with pytest.raises(ValueError, match=rf"--kv-events-config: cannot open '{config.endpoint}'"):
            kv_events.Publisher(config, 0, 4)
    finally:
        first.close()


# -- through `infc serve --device cpu` --------------------------------------------------------------
def test_serve_publishes_a_prompts_blocks_and_a_reset(tmp_path):
    from smollm2_from_gguf import ensure_smollm2
    cfg = {"enable_kv_cache_events": True, "endpoint": f"ipc://{tmp_path}/kv",
           "replay_endpoint": f"ipc://{tmp_path}/kv-replay", "topic": "kv@pod@tiny"}
    with serve_process(ensure_smollm2(), "--device", "cpu", "--max-model-len", "128",
                       "--kv-cache-memory-bytes", str(8 << 20), "--served-model-name", "tiny",
                       "--kv-events-config", json.dumps(cfg), "--uvicorn-log-level", "warning") as (port, out):
        assert f"KV events: bound ipc://{tmp_path}/kv, replay ipc://{tmp_path}/kv-replay" in out, out
        router = Router(cfg["endpoint"], cfg["replay_endpoint"], cfg["topic"])
        try:
            prompt = list(range(300, 330))     # 30 tokens and 4 generated: two full blocks of 16
            s, _, body = request(port, "POST", "/v1/completions", {
                "model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True})
            assert s == 200, body
            assert request(port, "POST", "/reset_prefix_cache")[0] == 200
            t0 = time.monotonic()
            while router.cleared == 0:
                for seq, payload in router.ask_replay(router.next):
                    router.take(seq, payload)
                assert time.monotonic() - t0 < 10, router.batches
            stored = [ev for b in router.batches for ev in b.events if isinstance(ev, BlockStored)]
            hashes = [h for ev in stored for h in ev.block_hashes]
            tokens = [t for ev in stored for t in ev.token_ids]
            assert tokens[:30] == prompt and len(tokens) == 32 and {ev.block_size for ev in stored} == {16}
            assert hashes == [wire_hash(prompt[:16]), wire_hash(tokens)]    # the second: 2 sampled tokens
            assert stored[0].parent_block_hash is None and router.prefix(hashes[1]) == tokens
            _, _, metrics = request(port, "GET", "/metrics")
            assert 'infc:kv_events_published_total{rank="0",model_name="tiny"}' in metrics.decode()
        finally:
            router.close()
