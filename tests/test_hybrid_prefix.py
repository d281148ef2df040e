"""Prefix caching for plans with slot caches (issue 44 part 3; runtime/engine/state_snapshots.py):
snapshots of each sequence's slot state at the block boundaries its prefill chunks end on, kept
with the cached blocks (and in the KV tiers), restored with a prefix hit.

StateFake stands in for a hybrid model where speed matters: FakeRunner's KV, plus a state per slot
(the crc of every token the sequence ran through) that a step reads only when the sequence has
tokens cached, as the linear-attention kernels do, and that every sampled token depends on: a
state not restored, or restored from another prefix, changes the outputs. The tiny Qwen3.5 plan
(random weights) checks the real path: a hit's logits at every position it computes equal a cold
run's within 1e-4 and 16 greedy tokens continue identically, with chunked prefill and from the
host tier."""
import json
import zlib

import numpy as np
import pytest

from infc.compiler.build import compile_model
from infc.compiler.contract import caches as C
from infc.runtime.engine.kv_tier.host_copies import HostCopies
from infc.runtime.engine.kv_tier.tiers import GIB, OffloadConfig
from infc.runtime.engine.runner import CPURunner
from infc.runtime.engine.sampling import SamplingParams
from infc.runtime.weights.dummy import dummy_weights

from exhaustive import EXHAUSTIVE
from fake_cuda import FakeContext
from test_kv_tier import TieredFake, _blocks_gib, _serve, _shared_prefix_prompts, abort_while_adding
from test_scheduler import assert_all_free, drain, make_engine

GREEDY = dict(temperature=0, ignore_eos=True)
FAKE_DECL = {"k": {"kind": "paged", "shape": [4], "dtype": "f32", "layers": [0]},       # 16 B a token
             "s": {"kind": "slot", "shape": [2], "dtype": "f32", "layers": [1]}}        # 8 B a state


class FakeStateCopies:
    """state_copies for StateFake: a snapshot is one int64."""

    def __init__(self, runner, num):
        self.r, self.num = runner, num
        self.pool = np.zeros(num, np.int64)
        self.snapshot_bytes = self.pool_bytes = 8
        self.pool_bytes = 8 * num

    def save(self, slot, snap):
        self.pool[snap] = self.r.state[slot]

    def restore(self, snap, slot):
        self.r.state[slot] = self.pool[snap]

    def tier_copies(self):
        return _PoolCopies(self.pool)


class _PoolCopies(HostCopies):
    """The snapshots' tier copies over the int64 pool (HostCopies' storage interface)."""

    def __init__(self, pool):
        self.pool, self.block_bytes, self.slab, self.seconds = pool, 8, None, {True: None, False: None}

    def save(self, pages, rows):
        self.slab[rows] = self.pool[pages].view(np.uint8).reshape(-1, 8)

    def load(self, pages, rows, after_steps=True):
        self.pool[pages] = self.slab[rows].view(np.int64).reshape(-1)


class LatePoolCopies(_PoolCopies):
    """A copy stream for the snapshots' tier copies (as test_kv_tier.LateCopies for blocks): a
    copy lands only when waited for (step_waits, host_wait) or, unwaited, two steps later, reading
    what the pool holds then; the steps and the slot <-> snapshot copies (the main stream) happen
    at once. A save not issued before its snapshot is written over, or a restore not waited for,
    moves the wrong state."""

    def __init__(self, pool):
        super().__init__(pool)
        self.queue, self.issued, self.steps = [], 0, 0

    def save(self, pages, rows):
        return self._later(super().save, pages, rows)

    def load(self, pages, rows, after_steps=True):
        return self._later(super().load, pages, rows)

    def _later(self, copy, pages, rows):
        self.queue.append((self.issued, self.steps, copy, list(pages), list(rows)))
        self.issued += 1
        return self.issued - 1

    def land(self, upto=None, before_step=None):
        while self.queue and ((upto is not None and self.queue[0][0] <= upto) or
                              (before_step is not None and self.queue[0][1] <= before_step)):
            _, _, copy, pages, rows = self.queue.pop(0)
            copy(pages, rows)

    def step_waits(self, fence):
        self.land(fence)

    def host_wait(self, fence):
        if fence is not None:
            self.land(fence)

    def stepped(self):
        self.steps += 1
        self.land(before_step=self.steps - 2)


class StateFake(TieredFake):
    def __init__(self, num_pages, num_slots=4, num_snapshots=4, late_state=False, **kw):
        super().__init__(num_pages, **kw)
        self.num_slots, self.num_snapshots = num_slots, num_snapshots
        self.state = np.zeros(num_slots + 1, np.int64)
        self.plan = {"caches": FAKE_DECL}
        self._copies = FakeStateCopies(self, num_snapshots) if num_snapshots else None
        if late_state:
            self._copies.tier_copies = lambda: self.__dict__.setdefault("late", LatePoolCopies(self._copies.pool))
        self.cold_reads = 0                     # rows that started from a zero state

    def state_copies(self):
        return self._copies

    def sample_contexts(self, meta, contexts, sampling):
        ctx = []
        for b, c in enumerate(contexts):
            lo, hi = int(meta.seq_starts[b]), int(meta.seq_starts[b + 1])
            slot = int(meta.state_slots[b])
            cached = int(meta.context_lens[b]) - (hi - lo)
            s = int(self.state[slot]) if cached > 0 else 0
            self.cold_reads += cached == 0
            s = zlib.crc32(np.asarray(meta.tokens[lo:hi], np.int64).tobytes(), s)
            self.state[slot] = s
            ctx.append(np.append(c, s))         # the token depends on the state as well
        if "late" in self.__dict__:
            self.late.stepped()
        return super().sample_contexts(meta, ctx, sampling)


def _fake_outputs(prompts, params, **kw):
    return _serve(make_engine(StateFake(24, num_snapshots=0), max_num_seqs=4, **kw), prompts, params)


@pytest.mark.parametrize("budget", [pytest.param(64, marks=EXHAUSTIVE), 7])
def test_fake_hybrid_outputs_with_prefix_caching_equal_without(budget):
    """80 requests over 12 shared prefixes, 24 pages (preemptions), 4 snapshots: hits happen,
    each restores its state, outputs are those of prefix caching off (recompute)."""
    rng = np.random.default_rng(5)
    prompts = _shared_prefix_prompts(rng, 80)
    params = SamplingParams(max_tokens=6, **GREEDY)
    want = _fake_outputs(prompts, params, max_num_batched_tokens=budget, enable_prefix_caching=False)
    r = StateFake(24)
    notes = []
    e = make_engine(r, max_num_seqs=4, max_num_batched_tokens=budget, log=notes.append)
    assert e.bm.enable_prefix_caching and e.snapshots is not None
    assert any("state snapshots" in n for n in notes)
    assert _serve(e, prompts, params) == want
    assert e.bm.hit_tokens > 0 and e.snapshots.restored > 0 and e.metrics.num_preemptions_total > 0
    assert_all_free(e)


def test_hits_end_where_a_snapshot_is_and_chunks_end_on_block_boundaries():
    r = StateFake(64, num_snapshots=8)
    e = make_engine(r, max_num_seqs=4, max_num_batched_tokens=7)
    prompt = list(range(1, 24))                              # 23 tokens, blocks of 4
    params = SamplingParams(max_tokens=3, **GREEDY)
    e.add_request(prompt, params, "a")
    first = drain(e)["a"][0]
    # chunks of at most 7 tokens ending on a block boundary: 4, 4, ..., then the last boundary
    # before the last token (20), then the rest
    prefill = [rows[0] for _, rows, smp in r.steps if not smp[0]]
    assert prefill == [4, 4, 4, 4, 4] and r.steps[5][1] == [3]
    assert len(e.snapshots.lru) == 5                         # at 4, 8, 12, 16, 20
    e.add_request(prompt, params, "b")
    outs = drain(e)
    assert outs["b"][0] == first
    assert e.bm.hit_tokens == 20
    # a prompt sharing 10 tokens: the hit stops at 8, the last boundary with a snapshot
    e.add_request(prompt[:10] + [90] * 5, params, "c")
    before = e.bm.hit_tokens
    drain(e)
    assert e.bm.hit_tokens - before == 8
    # a prompt shorter than a block reuses nothing (no full block)
    e.add_request(prompt[:3], params, "d")
    before = e.bm.hit_tokens
    drain(e)
    assert e.bm.hit_tokens == before
    assert_all_free(e)


def test_a_hit_without_its_snapshot_is_no_hit():
    """One chunk: the only snapshot is at the prompt's last boundary (20); with it gone the
    re-sent prompt's cached blocks are of no use (its state there is unknown): computed again."""
    from infc.runtime.engine.block_manager import prefix_hash
    r = StateFake(64, num_snapshots=8)
    e = make_engine(r, max_num_seqs=4)
    prompt = list(range(1, 24))
    params = SamplingParams(max_tokens=2, **GREEDY)
    e.add_request(prompt, params, "a")
    first = drain(e)["a"][0]
    assert list(e.snapshots.lru) == [prefix_hash(prompt[:20])]
    e.snapshots.forget(prefix_hash(prompt[:20]))
    assert e.bm.cached_blocks(_seq(prompt)) == 0
    e.add_request(prompt, params, "b")
    assert drain(e)["b"][0] == first and e.bm.hit_tokens == 0
    assert_all_free(e)



def test_reset_prefix_cache_forgets_the_snapshots_too():
    """vLLM's reset_prefix_cache: with no tier behind them, the snapshots of the forgotten blocks
    go with them (no lookup can reach them again), and the prompt is computed again, correctly."""
    r = StateFake(64, num_snapshots=8)
    e = make_engine(r, max_num_seqs=4, max_num_batched_tokens=7)
    prompt = list(range(1, 24))
    params = SamplingParams(max_tokens=2, **GREEDY)
    e.add_request(prompt, params, "a")
    first = drain(e)["a"][0]
    assert len(e.snapshots.lru) == 5
    assert e.reset_prefix_cache()
    assert len(e.snapshots.lru) == 0
    e.add_request(prompt, params, "b")
    assert drain(e)["b"][0] == first and e.bm.hit_tokens == 0
    assert_all_free(e)

def _seq(prompt):
    from infc.runtime.engine.sequence import Sequence
    return Sequence(0, "x", 0, prompt, SamplingParams(), 0)


def _tiers(tmp_path, host_blocks, disk_blocks=0):
    from infc.runtime.engine.kv_tier.disk_store import HEADER
    if not disk_blocks:
        return OffloadConfig(_blocks_gib(host_blocks))
    return OffloadConfig(_blocks_gib(host_blocks), str(tmp_path), _blocks_gib(disk_blocks) + disk_blocks * HEADER.size / GIB)


@pytest.mark.parametrize("disk,late", [pytest.param(False, False, marks=EXHAUSTIVE), (True, False), (False, True)])
def test_fake_hybrid_with_tiers_restores_state_from_the_host(tmp_path, disk, late):
    """2 snapshots in HBM, 24 pages: evicted blocks and snapshots go to the host tier (and on to
    the disk), and hits restore both from there; outputs equal prefix caching off. late: the
    snapshots' tier copies land only when waited for (a copy stream, LatePoolCopies)."""
    rng = np.random.default_rng(7)
    prompts = _shared_prefix_prompts(rng, 50)
    params = SamplingParams(max_tokens=6, **GREEDY)
    want = _fake_outputs(prompts, params, enable_prefix_caching=False)
    r = StateFake(24, num_snapshots=2, late_state=late)
    e = make_engine(r, max_num_seqs=4, kv_offloading=_tiers(tmp_path, 60 if disk else 1000, 1000 if disk else 0))
    st = e.snapshots.tiers
    assert st is not None and e.tiers is not None
    assert _serve(e, prompts, params) == want
    assert e.tiers.stats.host_hit_tokens + e.tiers.stats.disk_hit_tokens > 0
    assert st.stats.bytes_to_device > 0 and st.stats.bytes_to_host > 0     # snapshots came back
    if disk:
        assert st.stats.bytes_from_disk > 0
    e.step()
    assert_all_free(e)


def test_1000_aborts_hold_no_page_slot_snapshot_or_host_block(tmp_path):
    rng = np.random.default_rng(13)
    prompts = _shared_prefix_prompts(rng, 1000, stems=20)
    r = StateFake(32, num_slots=6, num_snapshots=3)
    e = make_engine(r, max_num_seqs=6, max_num_batched_tokens=9, kv_offloading=_tiers(tmp_path, 40))
    abort_while_adding(e, prompts, rng)
    assert not e.has_unfinished()
    assert_all_free(e)                      # bm.check(): the tiers' and the snapshots' too
    assert e.bm.num_free_slots == 6
    s = e.snapshots
    assert not s.restores and all(b.ref == 0 for b in s.blocks) and len(s.lru) + len(s.free) == s.num
    for t in (e.tiers, s.tiers):
        assert not t.saves and not t.loads and not t.pool.pins
        assert len(t.pool) + len(t.pool.free) == t.pool.num_rows
    assert s.restored > 0 and e.bm.hit_tokens > 0


def test_snapshot_copies_on_the_device_move_the_bytes_the_host_moves(fake_driver):
    """DeviceCaches.save_state / restore_state (runtime/cuda/state_copies.py's copies) against
    HostCaches' on the same random bytes, through the fake CUDA driver."""
    from infc.runtime.cuda.state_copies import DeviceStateCopies
    decl = {"k": {"kind": "paged", "shape": [2, 8], "dtype": "bf16", "layers": [0, 2]},
            "conv": {"kind": "slot", "shape": [3, 5], "dtype": "bf16", "layers": [1, 3]},
            "rec": {"kind": "slot", "shape": [2, 3, 3], "dtype": "f32", "layers": [1, 3]}}
    ctx = FakeContext()
    dev = C.DeviceCaches(ctx, decl, 4, num_pages=6, num_slots=3)
    host = C.HostCaches(decl, 4, 6, 3, factory=lambda shape, d: np.zeros(shape, np.uint16 if d == "bf16" else np.float32))
    rng = np.random.default_rng(3)
    for (name, layer), a in host.arrays.items():
        a.view(np.uint8)[...] = rng.integers(0, 256, a.view(np.uint8).shape, dtype=np.uint8)
        ptr, n = dev.region(name, layer)
        ctx.view(ptr, n)[:] = a.reshape(-1).view(np.uint8)
    copies = DeviceStateCopies(ctx, dev, 4)
    assert copies.snapshot_bytes == C.slot_bytes(decl)
    pool = C.HostCaches(C.snapshot_decl(decl), 1, 4, factory=host.factory)
    ctx.num_copies = 0
    for slot, snap in ((2, 3), (0, 1)):
        copies.save(slot, snap)
        host.save_state(pool, slot, snap)
    assert ctx.num_copies == 2 * 4                  # a copy a slot (cache, layer)
    copies.restore(3, 1)                            # slot 2's state into slot 1
    host.restore_state(pool, 3, 1)
    for (name, layer), a in host.arrays.items():
        ptr, n = dev.region(name, layer)
        assert ctx.view(ptr, n).tobytes() == a.reshape(-1).view(np.uint8).tobytes(), (name, layer)
    for (name, layer), a in pool.arrays.items():
        ptr, n = copies.pool.region(name, layer)
        kept = ctx.view(ptr, n).reshape(a.shape[0], -1)
        for snap in (1, 3):
            assert kept[snap].tobytes() == a[snap].tobytes(), (name, layer, snap)
    assert host.get("rec", 1)[1].tobytes() == host.get("rec", 1)[2].tobytes()     # slot 2's, in slot 1


# -- the tiny Qwen3.5 plan (the real CPU path: numpy slot caches, the reference executor) --------
TEXT = dict(architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text", vocab_size=128,
            hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
            linear_conv_kernel_dim=4, max_position_embeddings=256, hidden_act="silu",
            attention_bias=False, tie_word_embeddings=False,
            layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                             "mrope_section": [1, 1, 0], "mrope_interleaved": True})


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3_5-tiny")
    (d / "config.json").write_text(json.dumps(TEXT))
    _, plan = compile_model(model_dir=str(d), check_checkpoint=False)
    assert C.has_slots(C.of_plan(plan))
    return plan, dummy_weights(plan, seed=3)


class AllRows(CPURunner):
    """Every row's logits by position (one sequence at a time), as the last step computed it."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.rows = {}

    def forward(self, meta):
        logits, blocks = self.executor.step_paged(meta, list(range(meta.T)))
        for at, block in blocks:
            for j, row in enumerate(block):
                self.rows[int(meta.positions[at + j])] = np.array(row)
        return logits


def _engine(hybrid, caching=True, pages=64, budget=2048, **kw):
    from infc.runtime.engine.engine import Engine
    plan, w = hybrid
    runner = AllRows(plan, w, pages, 4, 4, kw.pop("snapshots", None))
    return Engine(runner, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=budget,
                  enable_prefix_caching=caching, **kw)


def _cold(hybrid, prompt, params, budget=2048):
    e = _engine(hybrid, caching=False, budget=budget)
    e.add_request(prompt, params, "cold")
    return drain(e)["cold"][0], dict(e.runner.rows)


def _same_logits(runner, cold_rows, first):
    assert min(runner.rows) == first                     # nothing before the hit was computed
    for p, row in runner.rows.items():
        assert np.abs(row - cold_rows[p]).max() <= 1e-4, p


@pytest.mark.parametrize("budget", [pytest.param(2048, marks=EXHAUSTIVE), 6], ids=["one-shot", "chunked"])
def test_qwen3_5_prefix_hit_logits_and_decode_equal_a_cold_run(hybrid, budget):
    rng = np.random.default_rng(4)
    prompt = rng.integers(0, 128, 30).tolist()
    params = SamplingParams(max_tokens=16, **GREEDY)
    want, cold_rows = _cold(hybrid, prompt, params)
    e = _engine(hybrid, budget=budget)
    e.add_request(prompt, params, "a")
    assert drain(e)["a"][0] == want
    e.runner.rows.clear()
    e.add_request(prompt, params, "b")
    assert drain(e)["b"][0] == want                      # 16 greedy tokens continue identically
    assert e.bm.hit_tokens == 28 and e.snapshots.restored == 1
    _same_logits(e.runner, cold_rows, 28)
    if budget == 6:                                      # chunks snapshotted at 4, 8, ..., 28
        other = prompt[:18] + rng.integers(0, 128, 9).tolist()
        want, cold_rows = _cold(hybrid, other, params)
        e.runner.rows.clear()
        e.add_request(other, params, "c")
        assert drain(e)["c"][0] == want and e.bm.hit_tokens == 28 + 16
        _same_logits(e.runner, cold_rows, 16)
    e.bm.check()


def test_qwen3_5_hit_from_the_host_tier(hybrid):
    """One snapshot in HBM and 12 pages: a second prompt evicts the first's blocks and snapshot
    to the host tier; the first, sent again, takes both from there, with a cold run's logits."""
    rng = np.random.default_rng(6)
    a, b = rng.integers(0, 128, 30).tolist(), rng.integers(0, 128, 30).tolist()
    params = SamplingParams(max_tokens=16, **GREEDY)
    want, cold_rows = _cold(hybrid, a, params)
    e = _engine(hybrid, pages=12, snapshots=1, kv_offloading=OffloadConfig(0.001))
    st = e.snapshots.tiers
    for rid, p in (("a", a), ("b", b)):
        e.add_request(p, params, rid)
        drain(e)
    assert e.bm.cached_blocks(_seq(a)) == 7 and not any(e.bm.cached.get(h) is not None for h in _seq_hashes(e, a))
    e.runner.rows.clear()
    e.add_request(a, params, "again")
    assert drain(e)["again"][0] == want
    assert e.tiers.stats.host_hit_tokens == 28 and st.stats.bytes_to_device == st.block_bytes
    _same_logits(e.runner, cold_rows, 28)
    e.step()
    e.bm.check()


def _seq_hashes(e, prompt):
    s = _seq(prompt)
    return [e.bm.block_hash(s, i) for i in range(len(prompt) // 4)]


def test_qwen3_5_outputs_with_prefix_caching_equal_without_under_pressure(hybrid):
    """12 requests over 3 shared 13..22-token prefixes, 4 at a time in 14 pages (preemptions),
    3 snapshots: outputs with prefix caching on equal those with it off."""
    rng = np.random.default_rng(9)
    stems = [rng.integers(0, 128, int(n)).tolist() for n in (13, 17, 22)]
    prompts = [stems[i % 3] + rng.integers(0, 128, int(rng.integers(1, 6))).tolist() for i in range(12)]
    params = SamplingParams(max_tokens=6, **GREEDY)
    outs = []
    for caching in (False, True):
        e = _engine(hybrid, caching=caching, pages=14, budget=16, snapshots=3)
        for i, p in enumerate(prompts):
            e.add_request(p, params, f"r{i}")
        got = drain(e)
        outs.append([got[f"r{i}"][0] for i in range(12)])
    assert outs[0] == outs[1]
    assert e.bm.hit_tokens > 0 and e.snapshots.restored > 0 and e.metrics.num_preemptions_total > 0
    assert_all_free(e)


def test_inspect_reports_the_snapshots_memory():
    """`infc inspect` of a plan with slot caches: a snapshot's bytes against the KV of a token
    (Qwen3.5-4B's caches: 49.1 MiB, the KV of 1,572 tokens), and per cached token."""
    from infc.compiler.memory_budget import snapshot_lines
    layers24, layers8 = list(range(24)), list(range(8))
    decl = {"conv": {"kind": "slot", "shape": [3, 8192], "dtype": "bf16", "layers": layers24},
            "k": {"kind": "paged", "shape": [4, 256], "dtype": "bf16", "layers": layers8},
            "recurrent": {"kind": "slot", "shape": [32, 128, 128], "dtype": "f32", "layers": layers24},
            "v": {"kind": "paged", "shape": [4, 256], "dtype": "bf16", "layers": layers8}}
    text = "\n".join(snapshot_lines({"caches": decl, "build": {"page_size": 16}}))
    assert "49.12 MiB = the KV of 1,572 tokens (32.0 KiB a token)" in text
    assert "49.1 KiB at one snapshot a 1k-token prefix, 3144.0 KiB at one a 16-token block" in text
    assert snapshot_lines({"caches": {n: decl[n] for n in "kv"}}) == []


def test_n_siblings_take_the_first_ones_prompt_and_state():
    """n = 3: the siblings wait for the first sequence's prompt, then hit it (its last block
    boundary's snapshot) and sample on their own seeds, as with prefix caching off."""
    prompt = list(range(3, 26))
    params = SamplingParams(n=3, max_tokens=5, temperature=1.0, seed=7, ignore_eos=True)
    outs = []
    for caching in (False, True):
        e = make_engine(StateFake(64, num_snapshots=4 if caching else 0), max_num_seqs=4,
                        enable_prefix_caching=caching)
        e.add_request(prompt, params, "n")
        outs.append(drain(e)["n"])
    assert outs[0] == outs[1] and len({tuple(v) for v in outs[1].values()}) == 3
    assert e.bm.hit_tokens == 2 * 20 and e.snapshots.restored == 2
    assert_all_free(e)


def test_num_state_snapshots_flag_reaches_the_runner_and_bad_values_fail():
    from infc.cli import parser
    from infc.config import EngineConfig, state_snapshots
    from infc.server.args import engine_config
    c = engine_config(parser().parse_args(["serve", "--model-path", "m", "--num-state-snapshots", "5"])).cache
    assert c.num_state_snapshots == 5 and state_snapshots(c, 64) == 5
    d = engine_config(parser().parse_args(["serve", "--model-path", "m", "--no-enable-prefix-caching"])).cache
    assert d.num_state_snapshots is None and state_snapshots(d, 64) == 0
    assert state_snapshots(EngineConfig().cache, 64) == 64          # default: one per sequence slot
    with pytest.raises(ValueError, match="--num-state-snapshots must be >= 0"):
        EngineConfig.from_settings(device="cpu", num_state_snapshots=-1).resolved(
            lambda: "cpu", lambda: pytest.fail("the cpu device needs no GPU table"))
