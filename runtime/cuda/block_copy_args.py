"""The block_copy kernel's tables (codegen_templates/triton/block_copy.py.j2), on the host (numpy
only): the regions of one copier's storage, made once, a batch's (page, row) pairs, and the runs
of consecutive rows a staged save copies to the host at once."""
import numpy as np


def region_table(layout, word: int, vec: int) -> np.ndarray | None:
    """int64 [R, 3]: (region offset, words a page, offset in the block) of each paged (cache,
    layer), in `word`-byte words (compiler/contract/caches.py Layout.block_regions). None when one
    of them, or the block, is not a whole number of vec words: the kernel would move them wrong
    (the copier then takes the driver's 2D copies)."""
    rows = layout.block_regions()
    unit = word * vec
    if not rows or layout.block_bytes % unit or any(x % unit for row in rows for x in row):
        return None
    return np.asarray(rows, np.int64).reshape(-1, 3) // word


def pairs(pages, rows, out: np.ndarray) -> int:
    """(page, row) of each block into out (int32 [>= n, 2]); returns n."""
    n = len(pages)
    out[:n, 0] = pages
    out[:n, 1] = rows
    return n


def pair_runs(pairs) -> list[tuple[int, int, int]]:
    """(a, b) pairs, in the order given -> (a, b, count) runs consecutive on both sides
    (a, b), (a + 1, b + 1), ...: one copy each."""
    runs = []
    for a, b in pairs:
        if runs and runs[-1][0] + runs[-1][2] == a and runs[-1][1] + runs[-1][2] == b:
            runs[-1][2] += 1
        else:
            runs.append([a, b, 1])
    return [tuple(r) for r in runs]


def row_runs(rows) -> list[tuple[int, int, int]]:
    """(index, first row, count) of each run of consecutive rows (rows[index:index + count] =
    first row, first row + 1, ...): one copy-engine transfer each from a staging buffer whose
    block k is rows[k]'s."""
    return pair_runs(enumerate(rows))
