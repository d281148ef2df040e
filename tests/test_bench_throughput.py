"""`infc bench throughput`'s point loop on the CPU: a fake runner under the real engine and
scheduler. The step clock accounts for every token the runner was given, by phase, and puts the
runner's own execute back afterwards."""
import numpy as np

from infc.bench.throughput import run_point
from test_scheduler import FakeRunner, make_engine


def test_run_point_accounts_every_step_and_restores_the_runner():
    runner = FakeRunner(num_pages=512)
    engine = make_engine(runner, max_num_batched_tokens=64, max_num_seqs=8)
    p = run_point(engine, runner.vocab_size, 4, 40, 6, np.random.default_rng(0))
    assert p["requests"] == 8
    steps = p["steps"]
    tokens = sum(v["tokens"] for v in steps["phases"].values())
    # 8 prompts of 40 computed once each (no shared prefixes: random prompts), and 5 decode
    # tokens each after the first token that the prefill samples
    assert tokens == 8 * 40 + 8 * 5, steps
    assert sum(v["steps"] for v in steps["phases"].values()) == len(runner.steps)
    assert "decode" in steps["phases"] and 0 <= steps["execute_s"] <= p["wall_s"]
    assert abs(steps["execute_s"] + steps["host_s"] - p["wall_s"]) < 1e-9
    assert "execute" not in vars(runner) and "collect" not in vars(runner)   # the class's methods again


def test_the_step_clock_reads_synchronous_steps_too():
    runner = FakeRunner(num_pages=512)
    engine = make_engine(runner, max_num_batched_tokens=64, max_num_seqs=8, overlap=False)
    p = run_point(engine, runner.vocab_size, 4, 40, 6, np.random.default_rng(0))
    steps = p["steps"]
    assert sum(v["tokens"] for v in steps["phases"].values()) == 8 * 40 + 8 * 5
    assert sum(v["steps"] for v in steps["phases"].values()) == len(runner.steps)
    assert "execute" not in vars(runner)


def test_the_step_clock_reads_data_parallel_steps(tiny_model):
    """Data-parallel ranks run a step as execute_ranks: the clock times those (rank 0's padded
    step: every rank's has its T), and every token computed lands in a phase."""
    from infc.compiler.build import compile_ranks
    from infc.compiler.parallel import settings
    from infc.runtime.engine.engine import Engine
    from infc.runtime.reference.ranks import rank_runner
    from infc.compiler.contract.safetensors_io import Checkpoint
    from infc.runtime.weights.load import load_weights
    d, _ = tiny_model("qwen3_moe")
    plans = [p for _, p in compile_ranks(settings(data_parallel_size=2, enable_expert_parallel=True),
                                         model_dir=str(d))]
    runner = rank_runner(plans, [load_weights(p, Checkpoint(d)) for p in plans], 64)
    engine = Engine(runner, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64)
    p = run_point(engine, runner.vocab_size, 2, 12, 3, np.random.default_rng(0), total=4)
    steps = p["steps"]
    assert p["requests"] == 4 and steps["execute_s"] > 0
    # each step is counted once at the padded T: at least the two ranks' share of 4 x (12 + 2)
    assert sum(v["tokens"] for v in steps["phases"].values()) >= 2 * (12 + 2)
    assert "execute_ranks" not in vars(runner)


class _Launched:
    """A data-parallel step's handle as MultiProcessRunner returns it: rank 0's step in `mine`."""

    def __init__(self, metas, samples):
        self.mine, self.samples = _RankStep(metas[0]), samples


class _RankStep:
    def __init__(self, meta):
        self.meta = meta

    def gpu_ms(self) -> float:
        return 2.0


class _OverlappedRanks:
    """Two data-parallel ranks whose steps are launched and collected (overlapped), each taking
    2 ms on rank 0's stream; every row samples token 1."""
    can_overlap, dp_world = True, 2

    def __init__(self, num_pages=1024, page_size=16):
        self.num_pages, self.page_size, self.vocab_size = num_pages, page_size, 97
        self.Ts = []

    def launch_ranks(self, metas, sampling, feeds):
        from infc.runtime.engine.runner import Sample
        self.Ts.append(metas[0].T)
        return _Launched(metas, [[None if s is None else Sample(1) for s in rows] for rows in sampling])

    def collect_ranks(self, handle):
        return handle.samples


def test_the_step_clock_reads_overlapped_data_parallel_steps():
    """Overlapped data-parallel steps are collected by collect_ranks: the clock reads rank 0's
    launched step (its meta and its time on the stream) from each handle, once a step."""
    from infc.runtime.engine.engine import Engine
    runner = _OverlappedRanks()
    engine = Engine(runner, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64)
    assert engine.overlap
    p = run_point(engine, runner.vocab_size, 4, 40, 6, np.random.default_rng(0))
    steps = p["steps"]
    assert p["requests"] == 8
    assert sum(v["steps"] for v in steps["phases"].values()) == len(runner.Ts)
    assert sum(v["tokens"] for v in steps["phases"].values()) == sum(runner.Ts)
    assert abs(steps["execute_s"] - 2e-3 * len(runner.Ts)) < 1e-9
    assert "collect_ranks" not in vars(runner)


def test_requests_take_the_adapters_in_turn():
    """--lora-modules: request i of a point asks for the (i mod n)-th adapter (8 adapters over 32
    concurrent requests: 4 each); without adapters every request is the base model's."""
    runner = FakeRunner(num_pages=512)
    engine = make_engine(runner, max_num_batched_tokens=64, max_num_seqs=8)
    asked = []
    add = engine.add_request

    def recording(*a, lora=None, **kw):
        asked.append(lora)
        return add(*a, **kw)
    engine.add_request = recording
    run_point(engine, runner.vocab_size, 4, 8, 2, np.random.default_rng(0), total=6, loras=("a", "b", "c"))
    run_point(engine, runner.vocab_size, 2, 8, 2, np.random.default_rng(0), total=2)
    assert asked == ["a", "b", "c", "a", "b", "c", None, None]


def test_the_step_series_is_every_step_in_order_with_the_tiers_copies():
    """--step-series: one entry a step, in the order run, (phase, T, ms, the host tier's bytes saved
    and steps made to wait, the engine thread's ms in the tier's flushes, the clock's ms by then);
    its tokens and times add up to the phases'; the tier's counts
    never fall and the point's wait count is the series' last minus what came before the point."""
    from test_kv_tier import OffloadConfig, TieredFake, _blocks_gib
    runner = TieredFake(48, late=True)
    engine = make_engine(runner, kv_offloading=OffloadConfig(_blocks_gib(1000)))
    rng = np.random.default_rng(0)
    run_point(engine, runner.vocab_size, 4, 40, 6, rng, total=4)          # fills the tier a first time
    before = engine.tiers.stats.step_waits
    p = run_point(engine, runner.vocab_size, 4, 40, 6, rng, total=12, series=True)
    series, phases = p["step_series"], p["steps"]["phases"]
    assert len(series) == sum(v["steps"] for v in phases.values())
    for ph, v in phases.items():
        mine = [s for s in series if s[0] == ph]
        assert sum(s[1] for s in mine) == v["tokens"]
        assert abs(sum(s[2] for s in mine) - v["execute_s"] * 1e3) < 1e-3 * len(mine)
    saved, waits = [s[3] for s in series], [s[4] for s in series]
    assert saved == sorted(saved) and waits == sorted(waits) and saved[-1] > 0
    assert p["steps"]["tier_step_waits"] == engine.tiers.stats.step_waits - before > 0
    assert waits[-1] - waits[0] <= p["steps"]["tier_step_waits"]
    flushed, clock = [s[5] for s in series], [s[6] for s in series]
    assert flushed == sorted(flushed) and 0 < flushed[-1] < clock[-1]
    assert clock == sorted(clock) and clock[-1] <= p["wall_s"] * 1e3
    assert engine.tiers.flush.__func__ is type(engine.tiers).flush     # the clock's timer removed
    assert "step_series" not in run_point(engine, runner.vocab_size, 2, 8, 2, rng, total=2)
