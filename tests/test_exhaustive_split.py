"""tests/exhaustive.py: the fast suite's pairwise rows cover every pair of values, and the fast and
exhaustive rows together are the whole product, each row once, named as stacked parametrize
decorators would name it."""
import itertools

import pytest

from exhaustive import EXHAUSTIVE, pairwise, pairwise_indices


@pytest.mark.parametrize("sizes", [[2, 3, 3], [5, 2, 2], [3, 4, 2, 3], [2, 2, 2, 2, 2]])
def test_the_pairwise_rows_cover_every_pair(sizes):
    rows = pairwise_indices(sizes)
    for (i, n), (j, m) in itertools.combinations(enumerate(sizes), 2):
        assert {(r[i], r[j]) for r in rows} == set(itertools.product(range(n), range(m))), (i, j)
    assert len(rows) < len(list(itertools.product(*map(range, sizes))))


def test_a_dropped_row_is_seen():
    """The check above fails a cover missing one pair."""
    rows = sorted(pairwise_indices([2, 3, 3]))
    short = rows[1:]
    missing = [(i, j) for i, j in itertools.combinations(range(3), 2)
               if {(r[i], r[j]) for r in short} != {(r[i], r[j]) for r in rows}]
    assert missing


def test_fast_and_exhaustive_rows_are_the_product_with_stacked_ids():
    cases = [(1, 2), (3, 4), (5, 6)]
    params = pairwise(cases, ["a", "b"], [False, True], ids=[["x", "y", "z"], None, None])
    assert [p.values for p in params] == [c + (s, b) for c in cases for s in "ab" for b in (False, True)]
    assert [p.id for p in params][:3] == ["x-a-False", "x-a-True", "x-b-False"]
    fast = [p for p in params if EXHAUSTIVE not in p.marks]
    assert 0 < len(fast) < len(params)
    assert all(p.marks == (EXHAUSTIVE,) for p in params if p not in fast)
