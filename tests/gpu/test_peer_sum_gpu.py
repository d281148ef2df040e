"""peer_sum (the one-shot all-reduce of runtime/cuda/p2p.py) with two ranks really waiting on each
other, on ONE GPU: each rank its own Context (its own stream) in this process, the regions plain
device memory both can address (what CUDA IPC gives two processes on two GPUs). The host issues
rank 0's launch, then rank 1's, without waiting: rank 0's kernel waits on the GPU until rank 1's
flags arrive. Checks, against the rank-ordered fp32 sum rounded once (the numpy reference):
  - 300 calls of random sizes (1..T_max rows, one to several programs, the slot parity going
    round) give those bits on both ranks;
  - CUDA Graphs that captured 6 calls each replay to the same bits, the epochs advancing on the
    device (each program's counter ends at the number of calls it made);
  - a rank left alone in peer_sum is freed by abort() (the watchdog's way out) within seconds.

Needs `python tests/gpu/prepare.py ranks` (tiny-qwen3 tp2: its all_reduce's p2p helper cubin).
"""
import time

import numpy as np
import pytest

import prepare
from infc.compiler.contract.safetensors_io import f32_to_bf16_bits as bf16_bits

T_MAX = 96


def bf16_float(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


class StubComm:
    """peer_sum never calls NCCL below the slot capacity; abort() is recorded."""

    def __init__(self, world, rank):
        self.world, self.rank, self.aborted = world, rank, False

    def all_reduce(self, *a, **k):
        raise AssertionError("a message under the slot capacity went to NCCL")

    def abort(self):
        self.aborted = True


@pytest.fixture(scope="module")
def two_ranks():
    from infc.runtime.cuda.artifact import load_kernels
    from infc.runtime.cuda.collectives import Buffer, CollectiveLaunch
    from infc.runtime.cuda.driver import Context
    from infc.runtime.cuda.p2p import P2PCollectives, RegionLayout
    from infc.runtime.cuda.ranks import load_rank_plans
    from infc.compiler.contract.program import launches
    art = prepare.ranks_artifact("tiny-qwen3", "tp2")
    if not (art / "bin").is_dir():
        pytest.skip(f"{art}/bin missing: run `python tests/gpu/prepare.py ranks` and carry .cache/gpu")
    plan = load_rank_plans(art)[0]
    ar = next(l for prog in plan["programs"].values() for l, _ in launches(prog) if l["op"] == "all_reduce")
    if "p2p" not in ar.get("helpers", {}):
        pytest.fail(f"{art} was built before peer_sum: rebuild it (prepare.py ranks)")
    ctxs = [Context(0), Context(0)]
    kernel = load_kernels(art, plan)[ar["helpers"]["p2p"]]
    shape = plan["buffers"][ar["inputs"][0]]["shape"]
    H = shape[1]
    layout = RegionLayout(2, 1 << 20)
    regions = [ctxs[0].alloc(layout.nbytes) for _ in range(2)]
    for p in regions:
        ctxs[0].memset(p, layout.nbytes)
    ctxs[0].sync()
    colls = [P2PCollectives(StubComm(2, r), ctxs[r], layout, regions[r], regions, free_local=False)
             for r in range(2)]
    xs = [ctxs[r].alloc(T_MAX * H * 2) for r in range(2)]
    outs = [ctxs[r].alloc(T_MAX * H * 2) for r in range(2)]
    place = {"T": T_MAX, "B": T_MAX}
    fires = [colls[r].bind(CollectiveLaunch("all_reduce", {}, [Buffer("x", xs[r], shape, "bf16")],
                                            [Buffer("y", outs[r], shape, "bf16")], {"p2p": kernel}, 0,
                                            place, "all_reduce (test)")) for r in range(2)]
    yield dict(ctxs=ctxs, colls=colls, xs=xs, outs=outs, fires=fires, H=H, layout=layout,
               regions=regions, dim=[d for d in shape if isinstance(d, str)][0], kernel=kernel)
    for c in ctxs:
        c.close()


def _upload(R, rng, T):
    parts = [bf16_bits(rng.standard_normal((T, R["H"])).astype(np.float32) * 3) for _ in range(2)]
    for r in range(2):
        R["ctxs"][r].htod(R["xs"][r], parts[r])
        R["ctxs"][r].sync()
    want = bf16_bits(bf16_float(parts[0]) + bf16_float(parts[1]))       # fp32 sum, rank order
    return want


def _check(R, T, want, what):
    for r in range(2):
        got = np.empty((T, R["H"]), np.uint16)
        R["ctxs"][r].dtoh(got, R["outs"][r])
        R["ctxs"][r].sync()
        assert np.array_equal(got, want), f"{what}: rank {r} differs from the rank-ordered sum"


def _counters(R):
    L = R["layout"]
    out = np.empty(64, np.int64)
    R["ctxs"][0].dtoh(out, R["regions"][0] + L.counter)
    R["ctxs"][0].sync()
    return out


def test_two_ranks_sum_to_the_reference_bits(two_ranks):
    R = two_ranks
    rng = np.random.default_rng(0)
    for i in range(300):
        T = int(rng.integers(1, T_MAX + 1))
        want = _upload(R, rng, T)
        dims = {R["dim"]: T, "T": T, "B": T}
        R["fires"][0](dims)                  # waits on the GPU for rank 1's flags
        R["fires"][1](dims)
        _check(R, T, want, f"call {i} (T={T})")
    assert all(c.errors() == 0 for c in R["colls"])


def test_graphs_replay_the_protocol(two_ranks):
    from infc.runtime.cuda.driver import Graph
    R = two_ranks
    rng = np.random.default_rng(1)
    T = T_MAX
    dims = {R["dim"]: T, "T": T, "B": T}
    before = _counters(R)
    graphs = [Graph(R["ctxs"][r], lambda r=r: [R["fires"][r](dims) for _ in range(6)]) for r in range(2)]
    for i in range(20):
        want = _upload(R, rng, T)
        graphs[0].launch()
        graphs[1].launch()
        _check(R, T, want, f"replay {i}")
    from infc.compiler.contract.bind import grid
    G = grid(R["kernel"].meta, dims)[0]
    grew = _counters(R) - before
    assert list(grew[:G]) == [120] * G and not grew[G:].any()


def test_abort_frees_a_rank_left_waiting(two_ranks):
    R = two_ranks
    T = 8
    dims = {R["dim"]: T, "T": T, "B": T}
    R["fires"][0](dims)                      # rank 1 never comes
    time.sleep(0.2)
    t0 = time.monotonic()
    R["colls"][0].abort()
    R["ctxs"][0].sync()
    assert time.monotonic() - t0 < 5 and R["colls"][0].comm.aborted
