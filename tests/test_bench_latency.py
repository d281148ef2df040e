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


def test_table_sets_each_peer_against_the_same_floor():
    res = {"floor_ms_by_prompt": {"32": 2.0}, "tpot_ms_by_prompt": {"32": 2.5}, "ttft_ms": {"32": 4.0},
           "hf_tpot_ms_by_prompt": {"32": 8.0}, "hf_ttft_ms": {"32": 40.0},
           "torch_compile_tpot_ms_by_prompt": {"32": 4.0}, "torch_compile_ttft_ms": {"32": 20.0}}
    rows = latency.table(res)
    assert rows[2:] == ["| 32 | infc | 2.500 | 2.000 | 80 % | 4.00 |",
                        "| 32 | HF static + compile | 8.000 | 2.000 | 25 % | 40.00 |",
                        "| 32 | torch.compile loop | 4.000 | 2.000 | 50 % | 20.00 |"]
    del res["torch_compile_tpot_ms_by_prompt"]
    res["torch_compile_error"] = "PeerUnsupported: model_type 'deepseek_v2'"
    assert latency.table(res)[-1] == "torch.compile loop: no row (PeerUnsupported: model_type 'deepseek_v2')"


def test_a_failing_peer_leaves_the_other(monkeypatch):
    """HF's failure is recorded and the torch.compile loop still runs on the same model; no model
    at all records the reason for both."""
    import infc.bench.torch_peer as peer
    monkeypatch.setattr(latency, "_hf_model", lambda path, fmt: "model")
    monkeypatch.setattr(latency, "_hf", lambda m, p, n: (_ for _ in ()).throw(RuntimeError("no graph")))
    monkeypatch.setattr(peer, "time_peer", lambda m, p, n: {"torch_compile_tpot_ms_by_prompt": {"32": 4.0}})
    res = {}
    latency._peers(res, "dir", [32], 8, "auto")
    assert res == {"hf_error": "RuntimeError: no graph", "torch_compile_tpot_ms_by_prompt": {"32": 4.0}}
    monkeypatch.setattr(latency, "_hf_model", lambda path, fmt: (_ for _ in ()).throw(OSError("no config")))
    res = {}
    latency._peers(res, "dir", [32], 8, "auto")
    assert res == {"hf_error": "OSError: no config", "torch_compile_error": "OSError: no config"}
