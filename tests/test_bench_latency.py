"""bench/latency.py's timing loop on a stub runner and a virtual clock: how many prefills and
decode steps it times, and that its TTFT median stands when two prefills are slow."""
from types import SimpleNamespace

import numpy as np

from infc.bench import latency


class _Stub:
    """A runner whose steps advance a virtual clock: a prefill of n tokens costs 5 ms (the
    prefills listed in `slow` cost 30 ms more), a decode step 3 ms."""
    page_size, num_pages, vocab_size = 16, 64, 1000

    def __init__(self, slow=()):
        self.now, self.prefills, self.decodes, self.slow = 0.0, 0, 0, set(slow)

    def _run(self, step):
        if len(step.tokens) > 1:
            self.now += 0.005 + (0.030 if self.prefills in self.slow else 0.0)
            self.prefills += 1
        else:
            self.now += 0.003
            self.decodes += 1
        return [SimpleNamespace(token=7)]

    def execute(self, step, sampling):
        return self._run(step)

    def launch(self, step, sampling, feed=None):
        return self._run(step)

    def collect(self, handle):
        return handle


def _run(stub, overlap):
    return latency._time_prompt(stub, 32, 8, np.random.default_rng(0), overlap, None, clock=lambda: stub.now)


def test_ttft_and_tpot_samples():
    for overlap in (False, True):
        stub = _Stub()
        ttfts, tpots = _run(stub, overlap)
        # one untimed prefill first, then TTFT_REPS timed ones; TPOT_REPS of them decode out_len steps
        assert stub.prefills == 1 + latency.TTFT_REPS and len(ttfts) == latency.TTFT_REPS
        assert stub.decodes == latency.TPOT_REPS * 8 and len(tpots) == latency.TPOT_REPS
        assert np.allclose(ttfts, 5.0) and np.allclose(tpots, 3.0)


def test_two_slow_prefills_do_not_move_the_ttft_median():
    # prefills 0 (the untimed one) and 1, 2 (the first two timed) are slow: with three samples
    # the median was 35 ms; over TTFT_REPS it is the 5 ms the rest took
    ttfts, _ = _run(_Stub(slow={0, 1, 2}), overlap=True)
    assert np.allclose(sorted(ttfts)[-2:], 35.0)
    assert np.isclose(np.median(ttfts), 5.0)
