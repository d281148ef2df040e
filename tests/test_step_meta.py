"""runtime/engine/step.py build_step: the step metadata, computed by numpy from the block tables, equals
the token-by-token definition (written out below) on random steps: decodes, prefill chunks that
start mid-page, empty chunks, fixed-width tables; and it refuses what cannot be laid out."""
import numpy as np
import pytest

from infc.runtime.engine.step import Chunk, build_step


def by_definition(chunks, pages_of, page_size, max_pages=None, slot_of=None):
    """Each token's position, KV slot and row, one at a time."""
    tokens, positions, starts, ctx, last, slots, tables = [], [], [0], [], [], [], []
    for c in chunks:
        pages = pages_of(c.seq_id)
        end = c.start + len(c.tokens)
        for p in range(c.start, end):
            positions.append(p)
            slots.append(pages[p // page_size] * page_size + p % page_size)
        tokens += c.tokens
        starts.append(starts[-1] + len(c.tokens))
        ctx.append(end)
        last.append(starts[-1] - 1)
        tables.append(pages)
    width = max_pages or max(len(t) for t in tables)
    bt = np.zeros((len(chunks), width), np.int32)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = t
    return tokens, positions, starts, ctx, last, slots, bt, width, \
        [slot_of(c.seq_id) if slot_of else 0 for c in chunks]


def random_step(rng, page_size):
    chunks, pages = [], {}
    free = list(rng.permutation(40000))
    for sid in range(int(rng.integers(1, 40))):
        start = int(rng.integers(0, 300))
        n = int(rng.choice([0, 1, 1, 1, int(rng.integers(2, 200))]))
        need = -(-(start + n) // page_size) + int(rng.integers(0, 3))     # sometimes a spare page
        pages[sid] = [int(free.pop()) for _ in range(max(need, 1))]
        chunks.append(Chunk(sid, rng.integers(0, 151936, n).tolist(), start))
    return chunks, pages


@pytest.mark.parametrize("page_size", [1, 16, 5])
@pytest.mark.parametrize("seed", range(6))
def test_build_step_equals_the_definition(page_size, seed):
    rng = np.random.default_rng(seed)
    chunks, pages = random_step(rng, page_size)
    if all(not c.tokens for c in chunks):
        chunks[0].tokens = [7]
        pages[chunks[0].seq_id] = pages[chunks[0].seq_id] + [40001, 40002]
    width = None if seed % 2 else max(len(p) for p in pages.values()) + 3
    slot_of = (lambda sid: 100 + sid) if seed % 3 == 0 else None
    m = build_step(chunks, pages.__getitem__, page_size, max_pages=width, slot_of=slot_of)
    tokens, positions, starts, ctx, last, slots, bt, w, state = by_definition(
        chunks, pages.__getitem__, page_size, width, slot_of)
    assert (m.T, m.B, m.max_pages) == (len(tokens), len(chunks), w)
    for got, want in ((m.tokens, tokens), (m.positions, positions), (m.seq_starts, starts),
                      (m.context_lens, ctx), (m.last_rows, last), (m.slot_mapping, slots),
                      (m.block_tables, bt), (m.state_slots, state)):
        assert got.dtype == np.int32 and got.tolist() == np.asarray(want).tolist()


def test_build_step_refuses_pages_that_cannot_hold_the_tokens():
    with pytest.raises(ValueError, match="sequence 4: 1 pages cannot hold 20 tokens"):
        build_step([Chunk(3, [1], 0), Chunk(4, [1] * 4, 16)], {3: [0], 4: [1]}.__getitem__, 16)


def test_build_step_refuses_a_table_wider_than_max_pages():
    with pytest.raises(ValueError, match="sequence 2: 3 pages, more than the 2"):
        build_step([Chunk(2, [1], 40)], {2: [5, 6, 7]}.__getitem__, 16, max_pages=2)
