"""The multi-process runtime on the CPU: the step channel (raw frames, no pickle) and N worker
processes, each running its rank plan on the numpy reference executor with the collectives
exchanged through rank 0, against the single-rank plan and runtime/reference/ranks.py's
simulated ranks; a killed worker turns into a clear error at rank 0's next step."""
import json
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from families import engine_greedy, engine_tokens

from infc.compiler.build import compile_model
from infc.compiler.build import compile_ranks
from infc.compiler.parallel import settings
from infc.runtime.distributed import step_channel as ch
from infc.runtime.engine.step import Chunk, StepMeta, build_step

FACTORY = "infc.runtime.distributed.rank_runners:reference_rank_runner"


# -- the channel ------------------------------------------------------------------------------
def random_meta(rng, B: int, with_slots=True) -> StepMeta:
    lens = [int(x) for x in rng.integers(1, 40, B)]
    starts = [int(x) for x in rng.integers(0, 50, B)]
    chunks = [Chunk(i, [int(t) for t in rng.integers(0, 151936, n)], s)
              for i, (n, s) in enumerate(zip(lens, starts))]
    pages = {i: [int(p) for p in rng.permutation(4096)[: (s + n + 15) // 16]]
             for i, (n, s) in enumerate(zip(lens, starts))}
    return build_step(chunks, pages.__getitem__, 16, slot_of=(lambda i: i * 3) if with_slots else None)


def empty_meta() -> StepMeta:
    z = np.zeros(0, np.int32)
    return StepMeta(0, 0, "decode", z, z, np.zeros(1, np.int32), z, z, z, np.zeros((0, 1), np.int32), 1)


def assert_same(a: StepMeta, b: StepMeta):
    for f in a.__dataclass_fields__:
        x, y = getattr(a, f), getattr(b, f)
        if isinstance(x, np.ndarray):
            assert isinstance(y, np.ndarray) and x.dtype == y.dtype and x.shape == y.shape, f
            assert np.array_equal(x, y), f
            assert y.flags.writeable and y.flags.c_contiguous
        else:
            assert type(x) is type(y) and x == y, f


@pytest.mark.parametrize("B", [1, 2, 7, 64, 256])
def test_step_round_trip(B, rng):
    for with_slots in (True, False):
        meta = random_meta(rng, B, with_slots)
        if not with_slots:
            meta.state_slots = None
        k, back = ch.decode_step(ch.encode_step(meta, 41))
        assert k == 41
        assert_same(meta, back)


def test_empty_and_large_steps_round_trip(rng):
    k, back = ch.decode_step(ch.encode_step(empty_meta(), 0))
    assert_same(empty_meta(), back)
    assert back.T == 0 and back.block_tables.shape == (0, 1)
    big = StepMeta(8192, 512, "prefill", *(rng.integers(0, 1 << 30, 8192, dtype=np.int32) for _ in range(2)),
                   np.arange(513, dtype=np.int32) * 16, rng.integers(0, 9999, 512, dtype=np.int32),
                   np.arange(512, dtype=np.int32), rng.integers(0, 1 << 20, 8192, dtype=np.int32),
                   rng.integers(0, 4096, (512, 300), dtype=np.int32), 300,
                   np.arange(512, dtype=np.int32))
    frame = ch.encode_step(big, 7)
    assert len(frame) < 8192 * 4 * 3 + 512 * 4 * 4 + 512 * 300 * 4 + 600     # raw bytes + a header
    assert_same(big, ch.decode_step(frame)[1])


def test_launch_frames_carry_the_rows_sampling_and_the_fed_tokens(rng):
    from infc.runtime.engine.runner import RowSampling
    from infc.runtime.engine.sampling import SamplingParams
    meta = random_meta(rng, 5, True)
    rows = [None, RowSampling(SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, logprobs=2),
                              (1 << 70) + 3, 4, (2, 9)),
            None, RowSampling(SamplingParams(temperature=0), 7, 0), None]
    k, items = ch.decode(ch.encode_launch(meta, 12, rows, [(3, 1), (4, 3)]))
    step, back, sampling, feed = ch.launch_of(k, items)
    assert step == 12 and feed == [(3, 1), (4, 3)]
    assert_same(meta, back)
    assert [s is None for s in sampling] == [True, False, True, False, True]
    a, b = sampling[1], sampling[3]
    assert (a.seed, a.step, a.banned) == ((1 << 70) + 3, 4, (2, 9)) and (b.seed, b.banned) == (7, ())
    p = a.params                    # what picks the token, exactly; logprobs stay on rank 0
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.logprobs) == (0.7, 5, 0.9, 0.05, None)
    assert ch.meta_of(k, items)[0] == 12                          # the step half alone
    bad = [(n, v[:1] if n == "top_k" else v) for n, v in items]
    with pytest.raises(ch.ChannelError, match="disagree in length"):
        ch.launch_of(k, bad)
    with pytest.raises(ch.ChannelError, match="sampling fields"):
        ch.launch_of(k, items[:-1])


def test_round_trip_over_a_socket(rng):
    a, b = socket.socketpair()
    try:
        metas = [random_meta(rng, B) for B in (1, 3, 200)] + [empty_meta()]
        for i, m in enumerate(metas):
            ch.send_frame(a, ch.encode_step(m, i))
        for i, m in enumerate(metas):
            k, back = ch.decode_step(ch.recv_frame(b, 5))
            assert k == i
            assert_same(m, back)
        a.close()
        with pytest.raises(ch.PeerGone, match="closed"):
            ch.recv_frame(b, 5)
    finally:
        b.close()


def test_receive_times_out():
    a, b = socket.socketpair()
    try:
        t = time.monotonic()
        with pytest.raises(ch.PeerGone, match="timeout"):
            ch.recv_frame(b, 0.2)
        assert time.monotonic() - t < 2
    finally:
        a.close()
        b.close()


def _patch(frame: bytes, at: int, new: bytes) -> bytes:
    return frame[:at] + new + frame[at + len(new):]


def test_malformed_frames_are_refused(rng):
    good = ch.encode_step(random_meta(rng, 3), 1)
    cases = [
        (b"", "shorter than"),
        (good[:7], "shorter than"),
        (_patch(good, 0, b"XXXX"), "bad magic"),
        (_patch(good, 4, (9).to_bytes(2, "little")), "version 9"),
        (_patch(good, 6, (77).to_bytes(2, "little")), "unknown frame kind 77"),
        (good[:-1], "truncated"),
        (good + b"\0", "trailing"),
        (_patch(good, 12, b"\x09"), "unknown tag 9"),
        (ch.encode(ch.STEP, [("step", 1)]), "StepMeta has"),
        (ch.encode(ch.ACK, [("step", 1)]), "expected a step frame"),
        (ch.encode(ch.STEP, [("step", 1)] + [(f, 1) for f in StepMeta.__dataclass_fields__]),
         "StepMeta wants"),
    ]
    # an array whose shape claims more bytes than the frame has
    arr = ch.encode(ch.ARRAYS, [("x", np.zeros(4, np.int32))])
    shape_at = arr.index(b"x") + 1 + 2                   # tag, name length, name | code, ndim | shape
    cases.append((_patch(arr, shape_at, (1 << 40).to_bytes(8, "little")), "needs"))
    cases.append((_patch(arr, shape_at - 2, b"\xee"), "unknown dtype code 238"))
    for frame, msg in cases:
        with pytest.raises(ch.ChannelError, match=msg):
            ch.decode_step(frame)
    with pytest.raises(ch.ChannelError, match="cannot go on the channel"):
        ch.encode(ch.ARRAYS, [("x", np.zeros(2, np.complex64))])
    with pytest.raises(ch.ChannelError, match="cannot go on the channel"):
        ch.encode(ch.ARRAYS, [("x", [1, 2])])
    a, b = socket.socketpair()
    try:
        a.sendall((1 << 62).to_bytes(8, "little"))
        with pytest.raises(ch.ChannelError, match="corrupt"):
            ch.recv_frame(b, 1)
    finally:
        a.close()
        b.close()


def test_no_pickle_on_the_channel(monkeypatch, rng):
    import infc.runtime
    root = Path(infc.runtime.__file__).parent / "distributed"
    for name in ("step_channel.py", "rank_workers.py"):
        assert "pickle" not in (root / name).read_text().replace("no pickle", ""), name
    import pickle

    def refuse(*a, **kw):
        raise AssertionError("pickle used on the step channel")
    for f in ("dumps", "loads", "dump", "load"):
        monkeypatch.setattr(pickle, f, refuse)
    monkeypatch.setattr(pickle, "Pickler", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    a, b = socket.socketpair()
    try:
        m = random_meta(rng, 5)
        ch.send_frame(a, ch.encode_step(m, 3))
        assert_same(m, ch.decode_step(ch.recv_frame(b, 5))[1])
    finally:
        a.close()
        b.close()


# -- N processes ------------------------------------------------------------------------------
def write_plans(d, tmp_path, **par) -> tuple[list, list[str]]:
    plans = [p for _, p in compile_ranks(settings(**par), model_dir=str(d))]
    paths = []
    for r, p in enumerate(plans):
        path = tmp_path / f"plan.rank{r}.json"
        path.write_text(json.dumps(p))
        paths.append(str(path))
    return plans, paths


def processes(d, paths, num_pages=32, **kw):
    from infc.runtime.distributed.rank_workers import MultiProcessRunner
    return MultiProcessRunner(FACTORY, {"plans": paths, "model_dir": str(d), "num_pages": num_pages},
                              world=len(paths), step_timeout=kw.pop("step_timeout", 60),
                              startup_timeout=120, **kw)


def test_two_processes_give_the_simulated_and_single_rank_logits(tiny_model, tmp_path, rng):
    from infc.runtime.reference.executor import ReferenceExecutor
    from infc.runtime.reference.ranks import RankExecutor
    from infc.compiler.contract.safetensors_io import Checkpoint
    from infc.runtime.weights.load import load_weights
    d, _ = tiny_model("qwen3")
    _, plan = compile_model(model_dir=str(d))
    one = ReferenceExecutor(plan, load_weights(plan, Checkpoint(d)))
    one.allocate_pages(32, 16)
    plans, paths = write_plans(d, tmp_path, tensor_parallel_size=2)
    sim = RankExecutor(plans, [load_weights(p, Checkpoint(d)) for p in plans])
    sim.allocate_pages(32, 16)
    prompts = {0: [int(t) for t in rng.integers(0, 320, 11)], 1: [int(t) for t in rng.integers(0, 320, 5)]}
    pages = {0: [3, 7], 1: [12]}
    steps = [build_step([Chunk(i, p, 0) for i, p in prompts.items()], pages.__getitem__, 16)]
    for k in range(3):                                        # decode steps
        steps.append(build_step([Chunk(i, [int(rng.integers(0, 320))], len(p) + k)
                                 for i, p in prompts.items()], pages.__getitem__, 16))
    runner = processes(d, paths)
    try:
        assert runner.num_pages == 32 and runner.page_size == 16
        for meta in steps:
            got = runner.logits(meta)
            assert np.array_equal(got, sim.step_paged(meta))          # the same bits as in one process
            np.testing.assert_allclose(got, one.step_paged(meta), rtol=1e-4, atol=1e-4)
    finally:
        runner.close()
    assert all(p.exitcode == 0 for p in runner.procs.values())


@pytest.mark.parametrize("fam,par", [("qwen3", dict(tensor_parallel_size=2)),
                                     ("qwen3_moe", dict(expert_parallel_only=2))],
                         ids=["qwen3-tp2", "qwen3_moe-ep2"])
def test_engine_over_two_processes_generates_the_single_rank_tokens(fam, par, tiny_model, tmp_path, rng):
    from infc.runtime.engine.runner import CPURunner
    from infc.compiler.contract.safetensors_io import Checkpoint
    from infc.runtime.weights.load import load_weights
    d, _ = tiny_model(fam)
    _, plan = compile_model(model_dir=str(d))
    prompts = [[int(t) for t in rng.integers(0, 320, n)] for n in (11, 4, 19)]
    want = engine_greedy(CPURunner(plan, load_weights(plan, Checkpoint(d)), 32), prompts, 6)
    _, paths = write_plans(d, tmp_path, **par)
    runner = processes(d, paths)
    try:
        assert engine_greedy(runner, prompts, 6) == want
    finally:
        runner.close()


@pytest.mark.parametrize("fam,par", [("qwen3", dict(tensor_parallel_size=2)),
                                     ("qwen3_moe", dict(tensor_parallel_size=2, enable_expert_parallel=True))],
                         ids=["qwen3-tp2", "qwen3_moe-tp2-ep2"])
def test_overlapped_steps_over_two_processes(fam, par, tiny_model, tmp_path, rng, monkeypatch):
    """Overlapped steps over ranks (INFC_RANK_OVERLAP=1 forces them on these CPU ranks; GPU
    ranks overlap by default): each step goes to the worker as a LAUNCH frame with its rows'
    sampling; the worker samples as rank 0 does and feeds the pending tokens itself. Greedy and
    seeded sampling give the tokens of synchronous steps over the same ranks, bit for bit."""
    from infc.runtime.engine.engine import Engine
    from infc.runtime.distributed.rank_workers import MultiProcessRunner
    from infc.runtime.engine.sampling import SamplingParams
    d, _ = tiny_model(fam)
    _, paths = write_plans(d, tmp_path, **par)
    prompts = [[int(t) for t in rng.integers(0, 320, n)] for n in (11, 4, 19, 7)]
    params = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=5, temperature=0.8, seed=5, ignore_eos=True),
              SamplingParams(max_tokens=7, temperature=1.0, top_k=20, seed=9, ignore_eos=True),
              SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)]
    got, launched = {}, []
    launch = MultiProcessRunner.launch
    monkeypatch.setattr(MultiProcessRunner, "launch",
                        lambda self, *a: launched.append(1) or launch(self, *a))
    monkeypatch.setenv("INFC_RANK_OVERLAP", "1")
    for overlap in (False, True):
        runner = processes(d, paths)
        try:
            got[overlap] = engine_tokens(runner, prompts, params, max_model_len=1024,
                                         max_num_batched_tokens=16, overlap=overlap)
        finally:
            runner.close()
    assert got[True] == got[False] and len(launched) >= 7      # every step launched
    assert [len(got[True][f"r{i}"]) for i in range(4)] == [6, 5, 7, 4]
    runner = processes(d, paths)
    try:
        monkeypatch.setenv("INFC_RANK_OVERLAP", "0")
        assert not Engine(runner, max_model_len=1024).overlap
        monkeypatch.delenv("INFC_RANK_OVERLAP")
        # by default only ranks whose runners do not compute at launch (GPUs) overlap
        assert not Engine(runner, max_model_len=1024).overlap
        own, runner.runner = runner.runner, type("DeviceRunner", (), {"launch": lambda *a: None})()
        assert runner.can_overlap
        runner.runner = own
    finally:
        runner.close()


@pytest.mark.parametrize("overlap", ["0", "1"], ids=["synchronous", "overlapped"])
def test_a_killed_worker_is_a_clear_error_at_the_next_step(overlap, tiny_model, tmp_path, rng, monkeypatch):
    """Synchronous or overlapped steps (a GPU's default over ranks: the error then comes from a
    LAUNCH frame or the collect of the step in flight)."""
    from infc.runtime.engine.engine import Engine
    from infc.runtime.distributed.rank_workers import RankError
    from infc.runtime.engine.sampling import SamplingParams
    d, _ = tiny_model("qwen3")
    _, paths = write_plans(d, tmp_path, tensor_parallel_size=2)
    monkeypatch.setenv("INFC_RANK_OVERLAP", overlap)
    runner = processes(d, paths, step_timeout=30)
    try:
        engine = Engine(runner, max_model_len=1024)
        assert engine.overlap == (overlap == "1")
        engine.add_request([int(t) for t in rng.integers(0, 320, 9)],
                           SamplingParams(max_tokens=50, temperature=0, ignore_eos=True), "r")
        for _ in range(3):
            engine.step()
        runner.procs[1].kill()
        runner.procs[1].join(5)
        t = time.monotonic()
        with pytest.raises(RankError, match=r"rank 1 \(pid \d+\) died \(killed by SIGKILL\)"):
            engine.step()
        assert time.monotonic() - t < 5
        with pytest.raises(RankError, match="the ranks are down"):
            engine.step()
    finally:
        runner.close()


def test_a_worker_killed_inside_a_step_is_an_error_not_a_hang(tiny_model, tmp_path, rng):
    """The worker dies while rank 0 waits in a collective: the exchange sees its socket close."""
    from infc.runtime.distributed.rank_workers import RankError
    d, _ = tiny_model("qwen3")
    _, paths = write_plans(d, tmp_path, tensor_parallel_size=2)
    runner = processes(d, paths, step_timeout=30)
    try:
        meta = build_step([Chunk(0, [1, 2, 3], 0)], lambda i: [0], 16)
        runner.logits(meta)
        import os
        import signal
        os.kill(runner.procs[1].pid, signal.SIGSTOP)          # stuck: rank 0 waits in the exchange
        threading.Timer(0.5, lambda: os.kill(runner.procs[1].pid, signal.SIGKILL)).start()
        t = time.monotonic()
        with pytest.raises(RankError, match="rank 1 .*died"):
            runner.logits(build_step([Chunk(0, [4], 3)], lambda i: [0], 16))
        assert time.monotonic() - t < 5
    finally:
        runner.close()


def test_a_worker_that_raises_reports_its_error(tiny_model, tmp_path):
    from infc.runtime.distributed.rank_workers import RankError
    d, _ = tiny_model("qwen3")
    _, paths = write_plans(d, tmp_path, tensor_parallel_size=2)
    paths[1] = paths[0]                                           # rank 1 gets rank 0's plan
    t = time.monotonic()
    with pytest.raises(RankError, match="rank 1 .*failed: ValueError: rank 1 of 2 got the plan of rank 0"):
        processes(d, paths)
    assert time.monotonic() - t < 60


# -- the watchdog (a collective that would wait forever, as NCCL's does for a dead rank) -------
# (tests/rank_factories.py blocking_factory: rank 0's step waits until abort() is called)



@pytest.mark.parametrize("kill", [True, False], ids=["worker-killed", "step-timeout"])
def test_the_watchdog_aborts_a_step_that_waits_for_a_dead_rank(kill):
    from infc.runtime.distributed.rank_workers import MultiProcessRunner, RankError
    runner = MultiProcessRunner("rank_factories:blocking_factory", {}, world=2,
                                step_timeout=30 if kill else 1.5, startup_timeout=120)
    try:
        ok = build_step([Chunk(0, [1], 0)], lambda i: [0], 16)
        assert runner.execute(ok, [None]) == [None]
        if kill:
            threading.Timer(0.5, runner.procs[1].kill).start()
        t = time.monotonic()
        with pytest.raises(RankError, match=r"rank 1 \(pid \d+\) died \(killed by SIGKILL\)" if kill
                           else "ran past step_timeout"):
            runner.execute(build_step([Chunk(0, [1, 2], 0)], lambda i: [0], 16), [None])
        assert time.monotonic() - t < 6 and runner.runner.aborted
    finally:
        runner.close()


@pytest.mark.parametrize("overlap", ["0", "1"], ids=["synchronous", "overlapped"])
def test_a_dead_worker_makes_the_async_engine_unhealthy(overlap, tiny_model, tmp_path, rng, monkeypatch):
    """The server's /health reads AsyncEngine.healthy (tests/test_server.py's engine-death test);
    with overlapped steps (GPU ranks' default) the error may come from the step in flight."""
    import asyncio

    from infc.runtime.engine.async_engine import AsyncEngine, EngineDeadError
    from infc.runtime.engine.engine import Engine
    from infc.runtime.engine.sampling import SamplingParams
    d, _ = tiny_model("qwen3")
    _, paths = write_plans(d, tmp_path, tensor_parallel_size=2)
    monkeypatch.setenv("INFC_RANK_OVERLAP", overlap)
    runner = processes(d, paths, step_timeout=30)
    engine = AsyncEngine(Engine(runner, max_model_len=1024))
    assert engine.engine.overlap == (overlap == "1")
    got = []

    async def go():
        async for o in engine.generate([int(t) for t in rng.integers(0, 320, 7)],
                                       SamplingParams(max_tokens=200, temperature=0, ignore_eos=True), "r"):
            got.append(o)
            if len(got) == 2:
                runner.procs[1].kill()
    try:
        t = time.monotonic()
        with pytest.raises(EngineDeadError, match=r"rank 1 \(pid \d+\) died"):
            asyncio.run(go())
        assert time.monotonic() - t < 10 and len(got) < 200
        assert not engine.healthy and "killed by SIGKILL" in repr(engine.error)
    finally:
        engine.shutdown()
        runner.close()


# -- the backend and `infc serve` flags -------------------------------------------------------
def test_cpu_backend_with_tensor_parallel_size_runs_rank_processes(tiny_model, rng):
    from infc.backend import load_backend
    from infc.runtime.distributed.rank_workers import MultiProcessRunner
    from infc.runtime.engine.sampling import SamplingParams
    d, _ = tiny_model("qwen3_moe")
    prompts = [[int(t) for t in rng.integers(0, 320, n)] for n in (6, 13)]
    outs = []
    for kw in ({}, dict(tensor_parallel_size=2, enable_expert_parallel=True),
               dict(data_parallel_size=2, enable_expert_parallel=True)):     # each rank its own sequences
        b = load_backend(d, device="cpu", asynchronous=False, log=None, max_model_len=256,
                         num_gpu_blocks_override=64, **kw)
        try:
            assert isinstance(b.engine.runner, MultiProcessRunner) == bool(kw)
            assert b.engine.dp == kw.get("data_parallel_size", 1)
            assert not b.engine.overlap       # the CPU computes at launch: nothing to overlap
            for i, p in enumerate(prompts):
                b.engine.add_request(p, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), f"r{i}")
            toks = {}
            while b.engine.has_unfinished():
                for o in b.engine.step():
                    toks.setdefault(o.request_id, []).extend(o.token_ids)
            outs.append(toks)
        finally:
            close = getattr(b.engine.runner, "close", None)
            if close and kw:
                close()
    assert outs[0] == outs[1] == outs[2]
    lines = []
    b = load_backend(d, device="cpu", asynchronous=False, log=lines.append, max_model_len=256,
                     num_gpu_blocks_override=64, overlap=False)
    assert not b.engine.overlap and "  steps synchronous" in lines


def test_serve_flags_reach_the_backend():
    import argparse

    from infc.server.args import add_serve_args, backend_kwargs
    p = argparse.ArgumentParser()
    add_serve_args(p)
    kw = backend_kwargs(p.parse_args(["--model-path", "x", "--tensor-parallel-size", "2",
                                      "--enable-expert-parallel"]))
    assert kw["tensor_parallel_size"] == 2 and kw["enable_expert_parallel"] is True
    kw = backend_kwargs(p.parse_args(["--model-path", "x"]))
    assert kw["tensor_parallel_size"] == 1 and kw["enable_expert_parallel"] is False
    assert kw["data_parallel_size"] == 1
    kw = backend_kwargs(p.parse_args(["--model-path", "x", "--data-parallel-size", "2", "--enable-expert-parallel"]))
    assert kw["data_parallel_size"] == 2 and kw["enable_expert_parallel"] is True


SERVED_RANKS = {"tp2": ("qwen3", dict(tensor_parallel_size=2)),
                # attention data-parallel: each rank its own sequences, the engine steps them all
                "dp2-ep2": ("qwen3_moe", dict(data_parallel_size=2, enable_expert_parallel=True))}


@pytest.fixture(params=list(SERVED_RANKS))
def rank_server(tiny_model, request):
    """(server thread, backend, runner): a tiny model served over two CPU rank processes, tensor-
    or data-parallel."""
    from infc.backend import load_backend
    from infc.server.app import ServerConfig, ServerState, make_app
    from infc.server.serve import ServerThread
    from test_server_support import request as http
    family, par = SERVED_RANKS[request.param]
    d, _ = tiny_model(family)
    b = load_backend(d, device="cpu", log=None, max_model_len=256, num_gpu_blocks_override=64, **par)
    runner = b.engine.engine.runner
    t = ServerThread(make_app(ServerState(ServerConfig(served_model_names=["m"]), b))).start()
    try:
        assert http(t.port, "GET", "/health")[0] == 200
        yield t, b, runner
    finally:
        t.stop()
        b.engine.shutdown()
        runner.close()


def test_server_over_rank_processes_then_a_dead_worker_is_health_503(rank_server):
    from test_server_support import request
    t, b, runner = rank_server
    body = {"model": "m", "prompt": [5, 9, 31, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    s, _, raw = request(t.port, "POST", "/v1/completions", body)
    assert s == 200 and json.loads(raw)["usage"]["completion_tokens"] == 4, raw
    runner.procs[1].kill()
    runner.procs[1].join(5)
    t0 = time.monotonic()
    s, _, raw = request(t.port, "POST", "/v1/completions", body, timeout=20)
    assert s in (500, 503) and b"rank 1" in raw, raw
    s, h, raw = request(t.port, "GET", "/health")
    assert s == 503 and b"rank 1" in raw and b"SIGKILL" in raw, raw
    assert time.monotonic() - t0 < 10


def test_a_worker_dying_while_idle_fails_health_without_a_request(rank_server):
    """The watchdog sees the death with no step in flight: /health turns 503 naming the rank
    within about a second, before any request would have found out."""
    from test_server_support import request
    t, b, runner = rank_server
    runner.procs[1].kill()
    t0 = time.monotonic()
    while request(t.port, "GET", "/health")[0] == 200:
        assert time.monotonic() - t0 < 5, "/health still 200 five seconds after rank 1 died"
        time.sleep(0.05)
    s, _, raw = request(t.port, "GET", "/health")
    assert s == 503 and b"rank 1" in raw and b"SIGKILL" in raw, raw
    assert not b.engine.healthy and runner.error is not None


def _spawned_ranks(pid: int) -> list[int]:
    """The multiprocessing-spawned children of `pid` (its rank workers, not the resource tracker)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmd = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid and b"spawn_main" in cmd:
            out.append(int(stat.parent.name))
    return out


def test_infc_serve_exits_with_a_clear_message_when_a_rank_dies(tiny_model):
    """`infc serve --tensor-parallel-size 2`: a killed rank process makes /health fail and the
    server exit with status 1 and a line naming the rank, instead of serving 503s forever.
    A tiny qwen3 on the CPU; on a GPU machine the server tests' variables pick the model, device
    and ranks (INFC_SERVER_MODEL, INFC_SERVER_DEVICE=cuda, INFC_SERVER_TP, INFC_SERVER_EP,
    INFC_SERVER_DP)."""
    import os
    import signal
    import subprocess
    import sys
    import urllib.error
    import urllib.request
    from test_server_support import DEVICE, MODEL_DIR, PARALLEL
    d = MODEL_DIR or tiny_model("qwen3")[0]
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    if PARALLEL["data_parallel_size"] > 1:       # attention data-parallel ranks (with EP)
        ranks = ["--data-parallel-size", str(PARALLEL["data_parallel_size"]), "--enable-expert-parallel"]
    else:
        ranks = ["--tensor-parallel-size", str(max(2, PARALLEL["tensor_parallel_size"]))]
        if PARALLEL["enable_expert_parallel"]:
            ranks.append("--enable-expert-parallel")
    proc = subprocess.Popen([sys.executable, "-m", "infc.cli", "serve", "--model-path", str(d),
                             "--device", DEVICE, *ranks, "--port", str(port), "--max-model-len", "256",
                             "--num-gpu-blocks-override", "64" if DEVICE == "cpu" else "2048",
                             "--disable-uvicorn-access-log"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def health():
        try:
            return urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status
        except urllib.error.HTTPError as e:
            return e.code
        except OSError:
            return None                             # not listening (yet, or any more)
    try:
        t0 = time.monotonic()
        while health() != 200:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() - t0 < 300, "infc serve did not become ready"
            time.sleep(0.2)
        workers = _spawned_ranks(proc.pid)
        assert len(workers) == int(ranks[1]) - 1, workers
        os.kill(workers[0], signal.SIGKILL)
        t0 = time.monotonic()
        seen = set()
        while proc.poll() is None:
            seen.add(health())
            assert time.monotonic() - t0 < 30, "infc serve still running 30 s after rank 1 died"
            time.sleep(0.05)
        out, err = proc.communicate(timeout=10)
        assert proc.returncode == 1, (proc.returncode, err[-2000:])
        assert 503 in seen, seen                     # /health failed before the port closed
        last = err.strip().splitlines()[-1]
        assert last.startswith("error: infc serve exits: the engine died") and "rank 1" in last \
            and "SIGKILL" in last, err[-2000:]
        assert "Traceback" not in err, err[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_llm_with_tensor_parallel_size_runs_the_rank_processes(tiny_model, rng):
    """LLM(tensor_parallel_size=2) on the cpu device: the same greedy tokens as one rank, and
    close() stops the rank process (vLLM's LLM takes the same argument)."""
    from infc import LLM, SamplingParams
    d, _ = tiny_model("qwen3")
    prompt = [int(t) for t in rng.integers(0, 320, 13)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    with LLM(d, device="cpu") as one:
        want = one.generate([prompt], params)[0].token_ids
    with LLM(d, device="cpu", tensor_parallel_size=2) as two:
        procs = list(two.runner.procs.values())          # rank 1's process
        assert len(procs) == 1 and procs[0].is_alive()
        assert two.generate([prompt], params)[0].token_ids == want
    for p in procs:
        p.join(timeout=10)
        assert not p.is_alive()

