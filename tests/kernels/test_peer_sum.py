"""peer_sum (the P2P collectives' one-shot all-reduce, runtime/cuda/p2p.py) under the interpreter.

The interpreter runs one rank at a time, so the other ranks are made to have arrived already: their
staging slot holds their rows and their flags for this call are up. The rank under test must then
stage its own rows, raise its flag in every rank's region, and write the rank-ordered fp32 sum
rounded once (the numpy reference's bits); a peer that never arrives ends the wait with *err = 1
instead of a hang. The concurrent case (two ranks really waiting on each other) runs on the GPU:
tests/gpu/test_peer_sum_gpu.py.
"""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from infc.compiler.ops import REGISTRY

from .harness import poison, rand, render, run

MAXG = 4


def kernel(world, H, dtype="bf16", out_dtype=None, block=64, spin=50):
    return render("peer_sum", "all_reduce", [("x", ["T", H], dtype)], [("y", ["T", H], out_dtype or dtype)],
                  attrs={"world": world, "max_programs": MAXG}, phase="collective",
                  tune={"BLOCK": block, "SPIN_LIMIT": spin})


class Regions:
    """Every rank's region as the kernel sees it: two staging slots, flag words, the calling
    rank's program counters and error word."""

    def __init__(self, world, slot_elems, dtype):
        self.world, self.slot = world, slot_elems
        self.stage = [poison((2 * slot_elems,), dtype) for _ in range(world)]
        self.flags = [torch.zeros(MAXG * world, dtype=torch.int64) for _ in range(world)]
        self.counter = torch.zeros(MAXG, dtype=torch.int64)
        self.err = torch.zeros(1, dtype=torch.int32)

    def arrive(self, q, rank, x, epoch, programs):
        """Rank q has run call `epoch` (its rows staged, its flags raised in `rank`'s region)."""
        base = (epoch % 2) * self.slot
        self.stage[q][base: base + x.numel()] = x.reshape(-1)
        for g in range(programs):
            self.flags[rank][g * self.world + q] = epoch

    def bindings(self, rank, x, out):
        W = self.world
        b = {"in:0": x, "out:0": out, "in:1": self.stage[rank], f"in:{2 + W}": self.flags[rank],
             f"in:{3 + 2 * W}": self.counter, f"in:{4 + 2 * W}": self.err,
             "arg:rank": rank, "arg:slot_elems": self.slot}
        for q in range(W):
            b[f"in:{2 + q}"] = self.stage[q]
            b[f"in:{3 + W + q}"] = self.flags[q]
        return b


def reference(xs):
    """The numpy all_reduce with every rank's input (as the simulated ranks hand it over)."""
    exchange = SimpleNamespace(inputs=lambda i: [x.float().numpy() for x in xs])
    return REGISTRY["all_reduce"].reference(SimpleNamespace(exchange=exchange), None)


@pytest.mark.parametrize("world,rank,T,H", [(2, 0, 13, 40), (2, 1, 13, 40), (3, 2, 5, 100), (2, 1, 1, 24)])
def test_peer_sum_is_the_rank_ordered_sum(world, rank, T, H):
    gen = np.random.default_rng(world * 10 + rank)
    k = kernel(world, H)
    n = T * H
    programs = min(-(-n // 64), MAXG)
    R = Regions(world, slot_elems=n + 7, dtype="bf16")
    for epoch in (1, 2, 3):                      # slots 1, 0, 1: each call its own parity
        xs = [rand((T, H), gen=gen) for _ in range(world)]
        for q in range(world):
            if q != rank:
                R.arrive(q, rank, xs[q], epoch, programs)
        out = poison((T, H))
        run(k, R.bindings(rank, xs[rank], out), {"T": T, "B": T})
        want = reference(xs)
        got = out.float().numpy()
        assert np.array_equal(got, torch.from_numpy(want).to(torch.bfloat16).float().numpy()), \
            f"epoch {epoch}: not the rank-ordered sum rounded once"
        base = (epoch % 2) * R.slot
        assert torch.equal(R.stage[rank][base: base + n], xs[rank].reshape(-1)), "own rows not staged"
        for q in range(world):                   # my flag raised in every rank's region
            got_flags = [int(R.flags[q][g * world + rank]) for g in range(MAXG)]
            assert got_flags == [epoch] * programs + [0] * (MAXG - programs), (q, got_flags)
        assert R.counter.tolist() == [epoch] * programs + [0] * (MAXG - programs)
        assert int(R.err[0]) == 0


def test_peer_sum_f32_partials_round_once():
    """fp32 partials in, bf16 out: the sum is rounded once, as one GPU rounds its GEMV output."""
    gen = np.random.default_rng(7)
    T, H, world = 6, 50, 2
    k = kernel(world, H, dtype="f32", out_dtype="bf16")
    R = Regions(world, slot_elems=T * H, dtype="f32")
    xs = [rand((T, H), "f32", gen=gen) for _ in range(world)]
    R.arrive(1, 0, xs[1], 1, min(-(-T * H // 64), MAXG))
    out = poison((T, H))
    run(k, R.bindings(0, xs[0], out), {"T": T, "B": T})
    want = (xs[0].double() + xs[1].double()).float().to(torch.bfloat16)
    assert torch.equal(out, want)


def test_a_peer_that_never_arrives_ends_the_wait_with_an_error():
    gen = np.random.default_rng(3)
    T, H, world = 3, 40, 2
    k = kernel(world, H, spin=20)
    R = Regions(world, slot_elems=T * H, dtype="bf16")
    out = poison((T, H))
    run(k, R.bindings(0, rand((T, H), gen=gen), out), {"T": T, "B": T})
    assert int(R.err[0]) == 1
