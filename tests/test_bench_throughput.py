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
