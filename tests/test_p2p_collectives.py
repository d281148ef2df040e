"""The P2P collectives (runtime/cuda/p2p.py) without a GPU: the host side around peer_sum.

peer_sum's protocol is tested on its own under the interpreter (tests/kernels/test_peer_sum.py)
and with two ranks really waiting on each other on a GPU (tests/gpu/test_peer_sum_gpu.py). Here,
on the fake device of tests/test_cuda_ranks.py, the rest: every rank's region laid out alike, the
rank under test's launch bound to the right regions, slot and flags (the other ranks made to have
arrived, since the interpreter runs one rank at a time), the result the numpy reference's bits;
a message over the slot capacity, or an artifact without the helper, goes to NCCL; the regions
are shared with IPC handles over an all-gather, and one rank that cannot map a peer makes every
rank fall back to NCCL alone.
"""
import importlib
import threading

import numpy as np
import pytest
import torch
from test_cuda_ranks import (FakeCtx, MinComms, _assert_bits, _ref, collective_launches, cuda_mods,  # noqa: F401
                             fake_device, fill_inputs, in_rank_threads)

H = 40


@pytest.fixture
def p2p(fake_device):
    return importlib.import_module("infc.runtime.cuda.p2p")


def _put_i64(ctx, ptr, value):
    ctx._at(ptr, 8).copy_(torch.tensor([value], dtype=torch.int64).view(torch.uint8))


def _get_i64(ctx, ptr):
    return int(ctx._at(ptr, 8).clone().view(torch.int64)[0])


def _regions(p2p, ctx, world, capacity):
    layout = p2p.RegionLayout(world, capacity)
    ptrs = [ctx.alloc(layout.nbytes) for _ in range(world)]
    for p in ptrs:
        ctx.memset(p, layout.nbytes)
    return layout, ptrs


class RecordingComm:
    def __init__(self, world, rank):
        self.world, self.rank, self.calls = world, rank, []

    def all_reduce(self, send, recv, count, dtype, stream, op="sum"):
        self.calls.append(("all_reduce", count, dtype))


@pytest.mark.parametrize("world,rank,T", [(2, 0, 7), (2, 1, 7), (3, 1, 5), (3, 2, 1)])
def test_peer_sum_launch_binds_this_ranks_regions(p2p, fake_device, world, rank, T, rng):
    """Rank `rank`'s all_reduce, ep_combine and all_reduce of fp32 partials into bf16, twice
    each (slots 1, 0, 1, 0, 1, 0): the rank-ordered sum's bits, its own rows staged in its region
    (in the partials' dtype), its flags raised in every region."""
    ctx = FakeCtx(8 << 20)
    layout, regions = _regions(p2p, ctx, world, capacity=T * H * 4 + 1000)
    coll = p2p.P2PCollectives(RecordingComm(world, rank), ctx, layout, regions[rank], regions,
                              free_local=False)
    programs = 1                                  # T * H <= 2048: one program
    epoch = 0
    launches = collective_launches(fake_device, ctx, world, T)
    for _ in range(2):
        for cls in [launches[0], launches[1], launches[5]]:   # all_reduce, ep_combine, fp32 partials
            x_dtype, out_dtype = cls[rank].inputs[0].dtype, cls[rank].outputs[0].dtype
            isz = 2 if x_dtype == "bf16" else 4
            slot = layout.slot_elems(isz)
            for c in cls:
                c.helpers["p2p"].meta["constexprs"]["SPIN_LIMIT"] = 200      # a wrong binding fails fast
            ins = fill_inputs(ctx, rng, cls, T, world)
            epoch += 1
            for q in range(world):                 # the others have arrived
                if q == rank:
                    continue
                base = regions[q] + layout.stage + (epoch % 2) * slot * isz
                ctx.put(base, ins[q][0], x_dtype)
                for g in range(programs):
                    _put_i64(ctx, regions[rank] + layout.flags + (g * world + q) * 8, epoch)
            coll.bind(cls[rank])({"T": T, "B": T})
            want = _ref(cls[0].op, ins, cls[0].attrs, world)[rank][0]
            got = ctx.get(cls[rank].outputs[0].ptr, [T, H], out_dtype)
            _assert_bits(got, want, out_dtype, f"{cls[0].op} {x_dtype} rank {rank} epoch {epoch}")
            mine = ctx.get(regions[rank] + layout.stage + (epoch % 2) * slot * isz, [T, H], x_dtype)
            assert np.array_equal(np.asarray(mine), np.asarray(ins[rank][0]))
            for q in range(world):
                assert _get_i64(ctx, regions[q] + layout.flags + rank * 8) == epoch
            assert _get_i64(ctx, regions[rank] + layout.counter) == epoch
    assert coll.peer_calls == 6 and coll.errors() == 0 and not coll.comm.calls


def test_large_messages_and_old_artifacts_go_to_nccl(p2p, fake_device, rng):
    """Over the slot capacity (a long prefill chunk) the all-reduce is NCCL's; an artifact built
    before peer_sum (no p2p helper) runs NCCL for every size."""
    ctx = FakeCtx(8 << 20)
    T = 9
    layout, regions = _regions(p2p, ctx, 2, capacity=256)       # 128 bf16 elements a slot
    comm = RecordingComm(2, 0)
    coll = p2p.P2PCollectives(comm, ctx, layout, regions[0], regions, free_local=False)
    ar = collective_launches(fake_device, ctx, 2, T)[0]
    fill_inputs(ctx, rng, ar, T, 2)
    coll.bind(ar[0])({"T": T, "B": T})
    assert comm.calls == [("all_reduce", T * H, "bf16")] and coll.peer_calls == 0
    ar[0].helpers.pop("p2p")
    layout, regions = _regions(p2p, ctx, 2, capacity=1 << 20)
    comm = RecordingComm(2, 0)
    coll = p2p.P2PCollectives(comm, ctx, layout, regions[0], regions, free_local=False)
    coll.bind(ar[0])({"T": 1, "B": 1})
    assert comm.calls == [("all_reduce", H, "bf16")] and coll.peer_calls == 0


class BytesComms(MinComms):
    """MinComms whose all_gather moves bytes of any dtype (the IPC handles are u8)."""
    SIZE = {"bf16": 2, "f16": 2, "f32": 4, "i32": 4, "u8": 1}

    def all_gather(self, rank, send, recv, count, dtype, stream):
        nb = count * self.SIZE[dtype]
        self.slots[rank] = self.ctx._at(send, nb).clone()
        self.barrier.wait()
        for q in range(self.world):
            self.ctx._at(recv + q * nb, nb).copy_(self.slots[q])
        self.barrier.wait()


@pytest.mark.parametrize("fail_rank", [None, 1])
def test_ranks_share_regions_or_all_fall_back(p2p, monkeypatch, capsys, fail_rank):
    """Every rank maps every other rank's region from its IPC handle (an all-gather); if one rank
    cannot map one, no rank takes the P2P path (they agree) and nothing stays mapped."""
    world = 3
    ctx = FakeCtx(8 << 20)
    comms = BytesComms(ctx, world)
    opened, closed, freed = [], [], []
    monkeypatch.setenv("INFC_P2P", "1")
    monkeypatch.setattr(p2p, "_alloc_region", lambda c, layout: c.alloc(layout.nbytes))
    monkeypatch.setattr(p2p, "_free_region", freed.append)
    monkeypatch.setattr(p2p, "ipc_handle", lambda ptr: int(ptr).to_bytes(8, "little") * 8)
    local = threading.local()

    def ipc_open(h):
        ptr = int.from_bytes(h[:8], "little")
        if local.rank == fail_rank:
            raise RuntimeError("CUDA_ERROR_PEER_ACCESS_UNSUPPORTED")
        opened.append((local.rank, ptr))
        return ptr + 0                      # a mapping of the peer's region
    monkeypatch.setattr(p2p, "ipc_open", ipc_open)
    monkeypatch.setattr(p2p, "ipc_close", closed.append)
    got = {}

    def run(r):
        local.rank = r
        got[r] = p2p.p2p_collectives(comms.comm(r), ctx, capacity=4096)
    in_rank_threads(comms, [lambda r=r: run(r) for r in range(world)])
    if fail_rank is None:
        assert all(isinstance(c, p2p.P2PCollectives) for c in got.values())
        locals_ = [got[r].local for r in range(world)]
        for r in range(world):
            assert got[r].regions == locals_
        assert sorted(opened) == sorted((r, locals_[q]) for r in range(world) for q in range(world) if q != r)
        assert not freed and not closed
    else:
        assert not any(isinstance(c, p2p.P2PCollectives) for c in got.values())
        assert sorted(closed) == sorted(p for _, p in opened) and len(freed) == world
        assert "one-shot all-reduce off" in capsys.readouterr().err


def test_p2p_off_by_environment_or_alone(p2p, monkeypatch):
    monkeypatch.setenv("INFC_P2P", "0")
    comm = RecordingComm(2, 0)
    assert type(p2p.p2p_collectives(comm, FakeCtx(1 << 16))).__name__ == "NcclCollectives"
    monkeypatch.setenv("INFC_P2P", "1")
    assert type(p2p.p2p_collectives(RecordingComm(1, 0), FakeCtx(1 << 16))).__name__ == "NcclCollectives"


def test_a_peer_sum_that_could_outrun_the_flag_rows_is_refused(p2p, fake_device):
    """The regions hold flags for p2p.MAX_PROGRAMS programs; a kernel whose META allows more
    (an artifact built with another bound) is an error at bind, not a write past the flags."""
    ctx = FakeCtx(4 << 20)
    layout, regions = _regions(p2p, ctx, 2, capacity=4096)
    coll = p2p.P2PCollectives(RecordingComm(2, 0), ctx, layout, regions[0], regions, free_local=False)
    ar = collective_launches(fake_device, ctx, 2, 3)[0]
    assert ar[0].helpers["p2p"].meta["max_programs"] <= p2p.MAX_PROGRAMS
    coll.bind(ar[0])
    ar[0].helpers["p2p"].meta["max_programs"] = p2p.MAX_PROGRAMS + 1
    with pytest.raises(ValueError, match="flags for 64.*rebuild"):
        coll.bind(ar[0])
