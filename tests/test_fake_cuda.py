"""tests/fake_cuda.py keeps its own contract: device memory behaves like the driver's copies say
(and a stray pointer fails), graphs keep the argument values of capture time, events read the
virtual clock, and the fixture leaves no stand-in cuda.bindings behind."""
import sys

import numpy as np
import pytest

import fake_cuda
from fake_cuda import FakeContext


def test_memory_copies_and_bounds():
    ctx = FakeContext(memory=1 << 16)
    a, b = ctx.alloc(100), ctx.alloc(64)
    assert a % 256 == 0 and b % 256 == 0 and ctx.read(a, 100) == bytes([fake_cuda.POISON]) * 100
    assert ctx.mem_info() == ((1 << 16) - 164, 1 << 16)
    host = np.arange(25, dtype=np.int32)
    ctx.htod(a, host)
    out = np.zeros(25, np.int32)
    assert ctx.dtoh(out, a) is out and (out == host).all()
    ctx.dtod(b, a + 8, 16)
    assert ctx.view(b, 4, np.int32).tolist() == [2, 3, 4, 5]
    ctx.memset(b, 4, 0xFF)
    ctx.memset32(b + 4, 2, 7)
    assert ctx.view(b, 3, np.int32).tolist() == [-1, 7, 7]
    ctx.htod_rows(b, 12, np.array([[1, 2], [3, 4]], np.int32))          # rows 12 bytes apart
    assert ctx.view(b, 5, np.int32).tolist() == [1, 2, 7, 3, 4]
    ctx.memcpy2d(a, 8, b, 12, 8, 2)                                     # back, rows 8 apart
    assert ctx.view(a, 4, np.int32).tolist() == [1, 2, 3, 4]
    pinned = ctx.pinned(8)
    pinned[:] = 9
    ctx.htod_raw(b, pinned.ctypes.data, 8)
    assert ctx.read(b, 8) == bytes([9]) * 8
    ctx.free_pinned(pinned)
    assert ctx.pinned_live == [] and ctx.num_copies == 6
    with pytest.raises(AssertionError, match="run past"):
        ctx.htod(b + 60, host)
    ctx.free(b)
    with pytest.raises(AssertionError, match="no live allocation"):
        ctx.read(b, 1)
    with pytest.raises(MemoryError):
        ctx.alloc(1 << 16)


def test_graphs_replay_capture_time_values_and_events_read_the_clock(fake_driver):
    ctx = fake_driver.Context()
    fn = fake_driver.Module(b'{"us": 3}').function("k")
    fake_driver.on_launch = lambda launch: launch.values[0]            # the first argument: µs
    args = fake_driver.PackedArgs([5, 0], ["i32", "*i8"])
    e0, e1 = ctx.event(), ctx.event()
    e0.record()
    fake_driver.launch(ctx, fn, (1, 1, 1), (32, 1, 1), 0, args)
    graph = fake_driver.Graph(ctx, lambda: fake_driver.launch(ctx, fn, (2, 1, 1), (32, 1, 1), 0, args))
    with pytest.raises(AssertionError, match="capturing"):
        fake_driver.Graph(ctx, lambda: ctx.sync())
    args.set(0, 1000)                         # after capture: the graph keeps 5
    graph.launch()
    e1.record()
    assert e1.ms_since(e0) == pytest.approx(0.010) and ctx.num_events == 2
    assert [(x.fn.name, x.grid, x.values, x.replay) for x in fake_driver.launches] == \
        [("k", (1, 1, 1), (5, 0), False), ("k", (2, 1, 1), (5, 0), True)]
    dep = fake_driver.DependentLaunch(ctx, (64, 1, 1), 0)
    dep(fn, (3, 1, 1), args)
    assert fake_driver.launches[-1].dependent and fake_driver.launches[-1].values == (1000, 0)


def test_the_stand_in_bindings_are_dropped_afterwards(monkeypatch):
    try:
        import cuda.bindings.driver  # noqa: F401
        pytest.skip("cuda-python is installed: no stand-in")
    except ImportError:
        pass
    with fake_cuda.cuda_modules():
        drv = fake_cuda.install(monkeypatch)
        from infc.runtime.cuda import driver, runner
        assert runner.Context is drv.Context and driver.launch == drv.launch
    assert not [n for n in sys.modules if n == "cuda" or n.startswith(("cuda.", "infc.runtime.cuda.driver",
                                                                        "infc.runtime.cuda.runner"))]
    with pytest.raises(ImportError):
        import infc.runtime.cuda.driver  # noqa: F401
