"""The split between the fast suite (`make test`) and the exhaustive one (`make test-all`, i.e.
`pytest --exhaustive`): a case marked `exhaustive` is collected always and run only with
--exhaustive (tests/conftest.py deselects it otherwise), so every case of a full matrix keeps its
test id and still runs before a kernel change is resolved.

`pairwise` keeps, of a cross product of independent parameters, a set of rows covering every pair
of values of any two axes in the fast suite (a defect showing for one value of one axis, or for a
combination of two, is still met); the other rows are marked exhaustive."""
import itertools

import pytest

EXHAUSTIVE = pytest.mark.exhaustive


def _pairs(row):
    return {(i, a, j, b) for (i, a), (j, b) in itertools.combinations(enumerate(row), 2)}


def pairwise_indices(sizes: list[int]) -> set[tuple]:
    """Index rows of the product of ranges of these sizes that together hold every pair (greedy:
    each next row the one covering most uncovered pairs; the first such row in product order)."""
    rows = list(itertools.product(*[range(n) for n in sizes]))
    if len(sizes) < 3:
        return set(rows)                     # with two axes every row is a pair of its own
    todo = set().union(*(_pairs(r) for r in rows))
    keep = set()
    while todo:
        best = max(rows, key=lambda r: (len(_pairs(r) & todo), -rows.index(r)))
        keep.add(best)
        todo -= _pairs(best)
    return keep


def pairwise(*axes, ids=None) -> list:
    """pytest.param rows of the product of `axes` (each a list of values, or of tuples to spread over
    several argnames): a pairwise cover unmarked, the rest marked exhaustive. The id of a row is its
    axes' ids joined by '-' (ids: one function or list per axis; default pytest's own ids), so
    `@pytest.mark.parametrize("a,b,c", pairwise(A, B, C))` names its cases as stacked
    parametrize decorators over A, B, C (listed innermost first) did."""
    keep = pairwise_indices([len(a) for a in axes])
    out = []
    for idx in itertools.product(*[range(len(a)) for a in axes]):
        values, names = (), []
        for k, (axis, i) in enumerate(zip(axes, idx)):
            v = axis[i]
            values += v if isinstance(v, tuple) else (v,)
            names.append(_id(ids[k] if ids else None, v, i))
        out.append(pytest.param(*values, id="-".join(names), marks=() if idx in keep else EXHAUSTIVE))
    return out


def _id(how, value, i) -> str:
    if callable(how):
        return str(how(value))
    if isinstance(how, (list, tuple)):
        return str(how[i])
    vals = value if isinstance(value, tuple) else (value,)
    return "-".join(_default_id(v, i) for v in vals)


def _default_id(v, i) -> str:
    """pytest's id for a value it can name (str, number, bool, None), else argname+index as pytest
    would give; callers whose values are dicts pass ids."""
    if isinstance(v, (str, int, float, bool)) or v is None:
        return str(v)
    raise ValueError(f"pairwise: pass ids for the value {v!r} (row {i})")
