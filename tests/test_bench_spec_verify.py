"""`infc bench spec-verify` on the CPU runner: a verify step's rows (B sequences, k + 1 positions
each, attending to C + 1 .. C + k + 1 tokens), the table's fields, and the rows a runner's
sequence limit leaves out."""
import numpy as np
import pytest

from infc.bench import spec_verify
from infc.runtime.engine.runner import CPURunner
from test_scheduler import tiny_plan  # noqa: F401


def test_verify_meta_rows():
    meta = spec_verify.verify_meta(3, 2, 40, 16, 4, np.random.default_rng(0), 100)
    assert (meta.T, meta.B, meta.phase) == (9, 9, "decode")
    assert meta.context_lens.tolist() == [41, 42, 43] * 3
    assert meta.positions.tolist() == [40, 41, 42] * 3
    assert meta.block_tables[3].tolist() == [4, 5, 6, 7]       # sequence 1's pages, each of its rows


def test_measure_on_cpu(tiny_plan):
    plan, weights = tiny_plan
    runner = CPURunner(plan, weights, 64, 16)
    runner.max_seqs = 6
    rows, skipped = spec_verify.measure(runner, [1, 2], [0, 2, 5], context=20, reps=1)
    assert [(r["batch"], r["drafts"], r["rows"]) for r in rows] == [(1, 0, 1), (1, 2, 3), (1, 5, 6), (2, 0, 2), (2, 2, 6)]
    assert skipped == [(2, 5)]
    assert all(r["ms"] > 0 for r in rows) and rows[0]["ratio"] == 1.0


def test_bad_lists():
    with pytest.raises(ValueError, match="--drafts"):
        spec_verify._ints("1,x", "--drafts")
    with pytest.raises(ValueError, match=">= 0"):
        spec_verify._ints("-1", "--batches")
