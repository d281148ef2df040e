"""Block manager units: chained block hashes, prefix reuse with reference counts, LRU eviction of
unreferenced cached blocks, and the accounting invariant after every sequence is released."""
import pytest

from infc.runtime.engine.block_manager import BlockManager, prefix_hash
from infc.runtime.engine.sampling import SamplingParams
from infc.runtime.engine.sequence import Sequence

PS = 4


def seq(tokens, sid=0):
    return Sequence(sid, f"r{sid}", 0, tokens, SamplingParams(), seed=0)


def run(bm, s, budget=1 << 20):
    """Admit s and pretend its whole chunk was computed (what the engine does after a step)."""
    n = bm.admit(s, budget)
    assert n > 0
    s.num_computed_tokens += n
    bm.commit(s)
    return n


def test_a_block_is_named_by_its_whole_prefix():
    a = prefix_hash([1, 2, 3, 4])
    assert a == prefix_hash([1, 2, 3, 4])
    assert a != prefix_hash([1, 2, 3, 5])
    # the same tokens after a different prefix are a different block
    assert prefix_hash([1, 2, 3, 4, 5, 6, 7, 8]) != prefix_hash([0, 2, 3, 4, 5, 6, 7, 8])


def test_block_hashes_extend_as_the_sequence_grows():
    """The manager hashes a sequence's new blocks in one batch through its running hasher; block
    i is prefix_hash of the tokens up to its end, whether the blocks come at once or as the
    sequence grows."""
    bm = BlockManager(64, PS)
    s = seq(list(range(100, 137)))                   # 9 full blocks and 1 token
    want = [prefix_hash(s.token_ids[:(i + 1) * PS]) for i in range(9)]
    assert bm._hashes(s, 3) == want[:3]
    assert bm._hashes(s, 9) == want                  # extends the three already made
    s.token_ids += [7, 8, 9]                         # block 9 fills
    assert bm._hashes(s, 10) == want + [prefix_hash(s.token_ids[:10 * PS])]
    assert bm._hashes(s, 2) == want[:2]


def test_reuse_longest_cached_prefix_with_ref_counts():
    bm = BlockManager(16, PS)
    a = seq(list(range(10)), 0)                      # blocks [0..3] [4..7] + 2 tokens
    run(bm, a)
    assert a.num_cached_tokens == 0 and len(a.pages) == 3
    b = seq(list(range(8)) + [50, 51, 52], 1)        # shares two full blocks, then differs
    n = run(bm, b)
    assert b.num_cached_tokens == 8 and n == 3
    assert b.pages[:2] == a.pages[:2] and b.pages[2] != a.pages[2]
    assert [bm.blocks[p].ref for p in a.pages] == [2, 2, 1]
    c = seq(list(range(4)) + [9, 9, 9, 9, 9], 2)     # shares only the first block
    run(bm, c)
    assert c.num_cached_tokens == 4 and bm.blocks[a.pages[0]].ref == 3
    assert bm.hit_tokens == 12 and bm.query_tokens == 10 + 11 + 9
    for s in (a, b, c):
        bm.release(s)
        bm.check()
    assert bm.num_free_pages == bm.num_pages and bm.usage == 0.0


def test_last_token_is_always_computed():
    bm = BlockManager(8, PS)
    run(bm, seq(list(range(8)), 0))                   # two full cached blocks
    again = seq(list(range(8)), 1)                     # the same 8 tokens: reuse 1 block, not 2
    assert run(bm, again) == 4 and again.num_cached_tokens == 4
    longer = seq(list(range(9)), 2)
    assert run(bm, longer) == 1 and longer.num_cached_tokens == 8


def test_cached_blocks_survive_release_until_evicted_lru():
    bm = BlockManager(4, PS)
    a = seq(list(range(12)) + [99], 0)               # 3 full blocks + 1 token: all 4 pages
    run(bm, a)
    bm.release(a)
    assert bm.num_free_pages == 4 and len(bm.cached) == 3      # evictable, still findable
    # a newcomer needing 2 pages evicts the LRU ones: a's pages went back tail first, so the
    # partial page and a's last full block go, its first two blocks stay
    other = seq([7] * 5, 1)
    run(bm, other)
    assert len(bm.cached) == 2 + 1                   # a's first two + other's one full block
    back = seq(list(range(12)) + [99], 2)
    n = bm.admit(back, 100)
    assert n == 0                                    # needs 2 cached + 2 new pages, 2 free
    bm.release(other)
    assert run(bm, back) == 5 and back.num_cached_tokens == 8
    bm.release(back)
    bm.check()
    assert bm.num_free_pages == 4


def test_admit_counts_revived_cached_pages_and_fails_cleanly():
    bm = BlockManager(3, PS)
    a = seq(list(range(8)) + [1], 0)                 # 3 pages, 2 cached blocks
    run(bm, a)
    bm.release(a)
    holder = seq([5, 5], 1)                          # takes the LRU page: a's partial page
    run(bm, holder)
    b = seq(list(range(8)) + [3, 4, 5, 6, 7], 2)     # 2 cached blocks, both unreferenced
    assert bm.admit(b, 1) == 0                       # 2 revived + 1 new page > 2 free
    assert not b.pages and b.num_computed_tokens == 0 and bm.num_free_pages == 2
    bm.release(holder)
    assert bm.admit(b, 100) == 0                     # 2 revived + 2 new > 3 free
    assert bm.admit(b, 4) == 4                       # a smaller chunk fits: 2 revived + 1 new
    assert b.num_cached_tokens == 8 and bm.num_free_pages == 0
    bm.release(b)
    bm.check()
    assert bm.num_free_pages == 3


def test_grow_and_no_prefix_cache():
    bm = BlockManager(4, PS, enable_prefix_caching=False)
    a = seq(list(range(8)), 0)
    run(bm, a)
    b = seq(list(range(8)) + [1], 1)
    assert bm.admit(b, 1) == 1 and b.num_cached_tokens == 0 and not bm.cached
    assert not bm.grow(a, 5) and bm.grow(a, 4) and len(a.pages) == 3
    bm.release(a)
    bm.release(b)
    with pytest.raises(AssertionError):              # a second release finds no reference
        b.pages = [0]
        bm.release(b)


def _want(tokens, n, lora=None):
    """Block i's hash from scratch: sha256 of the adapter's id (if any), then the tokens to its end."""
    import hashlib
    import numpy as np
    h = hashlib.sha256()
    if lora is not None:
        h.update(b"lora" + int(lora[1]).to_bytes(8, "little"))
    out = []
    for i in range(n):
        h.update(np.asarray(tokens[i * PS:(i + 1) * PS], np.int64).tobytes())
        out.append(h.copy().digest())
    return out


def test_a_prompt_that_begins_as_a_recent_one_takes_its_hashes():
    """recent_hashes.py: a prompt sharing a recent prompt's first tokens takes those blocks'
    hashes (counted), the running hasher then goes on from there; any divergence (inside a block,
    at a block's edge, none at all, a different adapter) gives the hashes of the tokens."""
    import random
    from infc.runtime.engine.sequence import PromptIds
    import numpy as np
    rng = random.Random(5)
    bm = BlockManager(64, PS)
    base = [rng.randrange(1000) for _ in range(60)]
    sid = iter(range(1000))
    cases = [(base, None, 0), (base, None, 14), (base[:37] + [7] * 11, None, 9),    # 9 full blocks shared
             (base[:36] + [5] * 12, None, 9), (base[:2] + [3] * 30, None, 0),      # inside block 0: none
             (base + [1, 2, 3, 4, 5], None, 9),     # the last kept: the one just above (base, ("a", 3), 0), (base[:20], ("a", 3), 5),
             (base[:20], ("b", 4), 0)]
    for tokens, lora, reused in cases:
        for make in (list, lambda t: PromptIds(t, np.asarray(t, np.int64))):
            before = bm.recent.reused_blocks
            s = seq(make(tokens), next(sid))
            s.lora = lora
            n = (len(tokens) - 1) // PS
            assert bm._hashes(s, n) == _want(tokens, n, lora), (len(tokens), lora)
            assert bm.recent.reused_blocks - before == (min(reused, n) if make is list else n), (len(tokens), lora)
            s.token_ids += [9, 8, 7, 6, 5, 4, 3, 2]          # grows: the hasher goes on past the taken ones
            m = len(s.token_ids) // PS
            assert bm._hashes(s, m) == _want(s.token_ids, m, lora)


def test_recent_prompts_are_kept_up_to_the_capacity():
    from infc.config import RECENT_PROMPT_HASHES
    bm = BlockManager(64, PS)
    prompts = [[i] * 9 for i in range(RECENT_PROMPT_HASHES + 1)]     # each its own first block
    for i, p in enumerate(prompts):
        bm._hashes(seq(p, i), 2)
    assert bm.recent.reused_blocks == 0 and len(bm.recent.prompts) == RECENT_PROMPT_HASHES
    bm._hashes(seq(prompts[0], 100), 2)                   # the least recent was dropped
    assert bm.recent.reused_blocks == 0
    bm._hashes(seq(prompts[-1], 101), 2)
    assert bm.recent.reused_blocks == 2
    bm.recent.capacity = 0                                 # none kept: every block hashed
    bm._hashes(seq(prompts[-1], 102), 2)
    assert bm.recent.reused_blocks == 2


def test_hits_and_misses_agree_with_and_without_recent_hashes():
    """The same admissions with the store off and on: the same hits, pages and hashes."""
    import random
    runs = []
    for capacity in (0, 16):
        bm, r = BlockManager(256, PS), random.Random(2)
        bm.recent.capacity = capacity
        base = [r.randrange(50) for _ in range(80)]
        got = []
        for i in range(40):
            cut = r.randrange(0, 81)
            s = seq(base[:cut] + [r.randrange(50) for _ in range(r.randrange(1, 12))], i)
            run(bm, s)
            got.append((s.num_cached_tokens, list(s.pages), list(s.block_hashes)))
            if r.random() < 0.7:
                bm.release(s)
            bm.check()
        runs.append(got)
    assert runs[0] == runs[1]
