"""Paged KV blocks: who holds which page, and the prefix cache over full blocks.

A full block is named by the hash of the whole prefix up to its end, sha256 of the token ids
(int64) from token 0, so two sequences whose hashes agree on block i agree on every token before
it. A sequence keeps the running hasher, so each token is hashed once (a 16k-token prompt in
~0.35 ms: chaining sha256(parent hash + block) a block at a time cost 3x that), and a prompt
that begins as a recent one did takes that prompt's hashes for those blocks (recent_hashes.py).
A new sequence takes the longest chain of cached blocks (a reference each) and computes only the
rest; its very last token is always computed, since the step must produce logits to sample from.

Every page is either referenced (ref > 0) or in `free`, an LRU queue. A page freed with a hash
stays findable there until an allocation takes it from the front and evicts its hash. A
sequence's pages go back tail first, so its later (less shared) blocks are evicted first.

State slots (plans with slot caches: conv and recurrent state, one entry per sequence): with
num_slots > 0 a sequence also takes a free slot at admission (no slot, no admission) and gives it
back with its pages (finish, abort, preemption). A preempted sequence is recomputed from token 0
(or, with state snapshots, from its last snapshot still cached), and kernels treat a sequence with
nothing cached as zero state, so a slot needs no reset.

KV tiers (`tiers`, kv_tier/tiers.py: --kv-offloading-size): a hashed page whose last reference
goes is offered to them (or, under INFC_KV_SAVE_AT_COMPUTE, its block once the step computing it
is issued: `computed`), and the prefix lookup goes on past the device's hits into them: a
block found there takes a fresh page, registered under its hash at once, and the engine's
flush copies it in before the step that reads it.

KV events (`events`: kv_events.py, --kv-events-config): a list while events are on, None while
off. A block that enters the cache (committed, or restored from a tier) is recorded "stored" with
its tokens and the hash of the block before it, runs of a sequence's consecutive blocks in one
event; a cached block whose page is taken is "removed"; reset_prefix_cache records "cleared". The
engine publishes and empties the list after each step.

State snapshots (`snapshots`, state_snapshots.py: plans with slot caches and prefix caching on): a
hit is cut back to the last block whose snapshot of the state there exists (pool or tiers), the
snapshot is acquired at admission and copied into the sequence's new slot before its first step;
chunks end at block boundaries (`chunk`) so that their ends can be snapshotted. A block evicted
from the cache (with no tiers behind it) takes its snapshot with it.

LoRA adapters (`lora`: runtime/lora/slots.py's LoraSlots): a sequence naming one is admitted only
with its adapter in a slot (admit / drop, alongside its pages), and its block hashes start from
the adapter's id, so one adapter's cached KV never serves another's or the base model's.
"""
import hashlib
from collections import OrderedDict

import numpy as np

from infc.config import DEFAULT_PAGE_SIZE, RECENT_PROMPT_HASHES
from .kv_events import MEDIUM_DEVICE
from .recent_hashes import RecentHashes
from .sequence import Sequence


def prefix_hash(tokens) -> bytes:
    """The name of the block that ends the prefix `tokens` (every token from the first)."""
    return hashlib.sha256(np.asarray(tokens, np.int64).tobytes()).digest()


def _hasher(seq: Sequence):
    """A sequence's first hasher: its adapter's id first, in 12 bytes, then its cache salt
    (vLLM's cache_salt: "salt", its length, its UTF-8 bytes, zero padding), so that the bytes
    before the tokens are 4 bytes past a whole number of int64 tokens: an adapter's or a salted
    block never has a plain block's name, nor one of another adapter or salt."""
    head = b"" if seq.lora is None else b"lora" + int(seq.lora[1]).to_bytes(8, "little")
    if seq.cache_salt is not None:
        salt = seq.cache_salt.encode()
        head += b"salt" + len(salt).to_bytes(8, "little") + salt
        head += bytes((4 - len(head)) % 8)
    return hashlib.sha256(head)


def _owner(seq: Sequence) -> tuple:
    """Whose blocks a sequence's hashes name (its adapter, its salt): recent_hashes.py's key."""
    return None if seq.lora is None else int(seq.lora[1]), seq.cache_salt


class Block:
    __slots__ = ("id", "ref", "hash")

    def __init__(self, block_id: int):
        self.id, self.ref, self.hash = block_id, 0, None


class BlockManager:
    def __init__(self, num_pages: int, page_size: int = DEFAULT_PAGE_SIZE, enable_prefix_caching: bool = True,
                 num_slots: int = 0, tiers=None):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"need num_pages >= 1 and page_size >= 1, got {num_pages}, {page_size}")
        self.num_pages, self.page_size = num_pages, page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_pages)]
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_pages))
        self.cached: dict[bytes, int] = {}        # hash -> page holding that block
        self.recent = RecentHashes(RECENT_PROMPT_HASHES, page_size)   # the last prompts' hashes
        self.query_tokens = 0                     # prompt tokens looked up at admission
        self.hit_tokens = 0                       # of those, found in the cache
        self.num_slots = num_slots
        self.free_slots: list[int] = list(range(num_slots - 1, -1, -1))   # pop() gives slot 0 first
        self.tiers = tiers                        # kv_tier.KVTiers, or None
        self.lora = None                          # LoraSlots where the plan serves adapters
        self.events: list | None = None           # KV events of the step running (kv_events.py)
        self.on_release = None                    # called with a sequence that gave its pages back
                                                  # (a draft model's shadow goes with it)
        self.snapshots = None                     # StateSnapshots where the plan has slot caches

    # -- accounting ---------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        """Pages not referenced by any sequence, cached-but-evictable ones included."""
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_pages

    @property
    def num_free_slots(self) -> int:
        return len(self.free_slots)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # -- hashes --------------------------------------------------------------------------------
    def _hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The prefix hashes of seq's first num_blocks full blocks (extended as tokens arrive):
        prefix_hash's bytes, the new blocks' tokens converted in one numpy call and fed to the
        sequence's running hasher (a 16k-token prompt is 1,024 blocks at admission). A sequence's
        first hashes are a recent prompt's where its tokens begin as that prompt's did
        (recent_hashes.py), the hasher brought past them in one update."""
        hs, ps = seq.block_hashes, self.page_size
        first = len(hs)
        if first < num_blocks:
            prompt = seq.prompt_array             # the check's array (PromptIds), where it covers
            if first == 0 and prompt is not None and len(prompt) >= num_blocks * ps:
                tokens = prompt[:num_blocks * ps]
            else:
                tokens = np.asarray(seq.token_ids[first * ps:num_blocks * ps], np.int64)
            raw = memoryview(tokens).cast("B")
            width = ps * 8
            h = seq.block_hasher or _hasher(seq)
            done = self.recent.reuse(_owner(seq), tokens, hs, num_blocks) if first == 0 else 0
            if done:
                h.update(raw[:done * width])
            for j in range(done, num_blocks - first):
                h.update(raw[j * width:(j + 1) * width])
                hs.append(h.copy().digest())
            seq.block_hasher = h
            if first == 0:
                self.recent.remember(_owner(seq), tokens, hs)
        return hs[:num_blocks]

    def block_hash(self, seq: Sequence, i: int) -> bytes:
        """The prefix hash of seq's block i (its tokens must be known)."""
        return self._hashes(seq, i + 1)[i]

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        # a sequence that scores its prompt computes every row (cached rows have no logits: vLLM
        # too skips the prefix cache for prompt logprobs); its blocks still enter the cache
        if not self.enable_prefix_caching or seq.scores_prompt:
            return []
        hashes = self._hashes(seq, (seq.num_tokens - 1) // self.page_size)
        pages = list(map(self.cached.get, hashes))   # the device's pages, in one C loop
        n = pages.index(None) if None in pages else len(pages)
        hits = pages[:n]
        if self.tiers is not None:                # past the device's hits, on into the tiers
            for h, page in zip(hashes[n:], pages[n:]):
                if page is None and not self.tiers.find(h):
                    break
                hits.append(page)                 # None: in a tier
        if self.snapshots is not None:            # the state must be restorable where the hit ends
            del hits[self.snapshots.longest(seq.block_hashes, len(hits)):]
        return hits

    def chunk(self, seq: Sequence, start: int, n: int) -> int:
        """How many of the n tokens from `start` the step computes: with state snapshots, a chunk
        that stops short of the sequence's end stops at a block boundary, and a prefill chunk
        reaching it stops at the last block boundary before its last token (the longest prefix a
        re-sent prompt can hit), so each chunk's end can be snapshotted. That costs a prompt one
        step more: its last (at most page_size) tokens run in a step of their own."""
        if self.snapshots is None or n <= 1:
            return n
        ps, end = self.page_size, start + n
        cut = end // ps * ps if end < seq.num_tokens else (seq.num_tokens - 1) // ps * ps
        return cut - start if cut > start else n

    def cached_blocks(self, seq: Sequence) -> int:
        """How many of seq's leading full blocks this cache holds now (what admission would hit)."""
        return len(self._cached_prefix(seq))

    # -- allocation ----------------------------------------------------------------------------
    def _new_page(self) -> int:
        page, _ = self.free.popitem(last=False)   # least recently freed: evict its hash
        b = self.blocks[page]
        if b.hash is not None:
            if self.cached.get(b.hash) == page:
                del self.cached[b.hash]
                if self.events is not None:
                    self.record_removed(b.hash)
                if self.snapshots is not None and self.tiers is None:
                    self.snapshots.forget(b.hash)
            b.hash = None
        b.ref = 1
        if self.tiers is not None:
            self.tiers.reusing(page)
        return page

    def admit(self, seq: Sequence, budget: int) -> int:
        """Give a sequence with no KV its cached prefix and pages for its first chunk (at most
        `budget` tokens). Returns the chunk's token count, or 0 when the pages are not there."""
        assert not seq.pages and seq.num_computed_tokens == 0, seq
        hits = self._cached_prefix(seq)
        rows = self.tiers.fetch(seq.block_hashes, hits) if None in hits else []   # cuts hits
        snap = None
        if self.snapshots is not None and hits:
            keep = self.snapshots.longest(seq.block_hashes, len(hits))    # a tier fetch may cut hits
            snap = self.snapshots.acquire(seq.block_hashes[keep - 1]) if keep else None
            keep = keep if snap is not None else 0
            if keep < len(hits):
                kept = sum(p is None for p in hits[:keep])
                if rows:
                    self.tiers.unfetch(rows[kept:])
                del hits[keep:], rows[kept:]
        cached = len(hits) * self.page_size
        n = self.chunk(seq, cached, min(seq.num_tokens - cached, budget))
        new = self.pages_for(cached + n) - len(hits)
        # evictable hits (unreferenced: in `free`) leave it; a tier block takes a page of it
        device = [p for p in hits if p is not None] if None in hits else hits
        leaving = self.free.keys() & device       # a set, made in C (a 16k hit: 1,024 pages)
        revived = len(leaving) + (len(hits) - len(device))
        # the adapter's slot is asked for last: only once the pages and state slot are there
        if n <= 0 or new + revived > len(self.free) or (self.num_slots and not self.free_slots) \
                or (self.lora is not None and not self.lora.admit(seq)):
            if rows:
                self.tiers.unfetch(rows)
            if snap is not None:
                self.snapshots.release(snap)
            return 0
        if self.num_slots:
            seq.slot = self.free_slots.pop()
        if snap is not None:
            self.snapshots.restore(snap, seq)
        blocks = self.blocks
        for p in device:                          # a reference more to each cached page
            blocks[p].ref += 1
        for p in leaving:
            del self.free[p]
        if leaving and self.tiers is not None:   # one call a hit: a 32k prompt's is 2,048 pages
            self.tiers.taken([p for p in device if p in leaving], self.free)
        if rows:
            tier = [i for i, p in enumerate(hits) if p is None]
            hits = self._restored(seq.block_hashes, hits, rows)
            self.tiers.admitted()
            if self.events is not None:            # back in the device's cache
                self._record_stored(seq, tier)
        seq.pages = hits + [self._new_page() for _ in range(new)]
        seq.num_computed_tokens = seq.num_cached_tokens = cached
        seq.num_committed_blocks = len(hits)
        self.query_tokens += seq.num_tokens
        self.hit_tokens += cached - len(rows) * self.page_size    # the device's own hits
        return n

    def _restored(self, hashes: list[bytes], hits: list, rows: list[int]) -> list[int]:
        """hits with each tier block (None) on a fresh page that holds its hash from now on, its
        copy from host row rows[i] pending until the engine's flush. The fresh pages go to the
        blocks in the order of their rows, ascending: where rows run on consecutively, so do the
        pages, and the device copies them as one run (runtime/cuda/kv_copies.py)."""
        tier = [i for i, p in enumerate(hits) if p is None]
        pages = sorted(self._new_page() for _ in tier)
        out = list(hits)
        for j, p in zip(sorted(range(len(tier)), key=rows.__getitem__), pages):
            h = hashes[tier[j]]
            self.blocks[p].hash = h
            self.cached[h] = p
            self.tiers.restore(h, p, rows[j])
            out[tier[j]] = p
        return out

    def grow(self, seq: Sequence, n: int) -> bool:
        """Pages for n more tokens of a running sequence; False when there are not enough."""
        need = self.pages_for(seq.num_computed_tokens + n) - len(seq.pages)
        if need > len(self.free):
            return False
        seq.pages += [self._new_page() for _ in range(need)]
        return True

    def truncate(self, seq: Sequence):
        """Give back the pages past the sequence's computed tokens (speculative decoding: pages
        taken for drafts that were rejected). They were new and never full of known tokens, so
        they hold no cached block; they go to the front of the free queue, to be taken first."""
        keep = self.pages_for(seq.num_computed_tokens)
        for page in reversed(seq.pages[keep:]):
            b = self.blocks[page]
            assert b.ref == 1 and b.hash is None, f"page {page} of {seq} is shared or cached"
            b.ref = 0
            self.free[page] = None
            self.free.move_to_end(page, last=False)
        del seq.pages[keep:]

    def commit(self, seq: Sequence):
        """After a step: offer the sequence's newly full, computed blocks to the prefix cache (those
        whose token ids are all known: a pending token's block waits for it)."""
        full = min(seq.num_computed_tokens, len(seq.token_ids)) // self.page_size
        if not self.enable_prefix_caching or full <= seq.num_committed_blocks:
            return
        stored = []
        for i, h in enumerate(self._hashes(seq, full)[seq.num_committed_blocks:], seq.num_committed_blocks):
            b = self.blocks[seq.pages[i]]
            if h not in self.cached and b.hash is None:
                self.cached[h] = b.id
                b.hash = h
                stored.append(i)
                if self.tiers is not None:        # (saved now under INFC_KV_SAVE_AT_COMPUTE)
                    self.tiers.computed(h, b.id)
        seq.num_committed_blocks = full
        if stored and self.events is not None:
            self._record_stored(seq, stored)

    # -- KV events -----------------------------------------------------------------------------
    def _record_stored(self, seq: Sequence, blocks: list[int]):
        """Blocks of seq (ascending indices) entered the cache: one event a run of consecutive
        ones, with the run's tokens and the hash of the block before it (None: the first)."""
        hs, ps = seq.block_hashes, self.page_size
        start = 0
        for k in range(1, len(blocks) + 1):
            if k == len(blocks) or blocks[k] != blocks[k - 1] + 1:
                first, last = blocks[start], blocks[k - 1]
                self.events.append(("stored", hs[first:last + 1], hs[first - 1] if first else None,
                                    seq.token_ids[first * ps:(last + 1) * ps], seq.lora, MEDIUM_DEVICE))
                start = k

    def record_removed(self, h: bytes):
        """Block h left the device's cache (its page taken, or demoted to a tier)."""
        last = self.events[-1] if self.events else None
        if last is not None and last[0] == "removed" and last[2] == MEDIUM_DEVICE:
            last[1].append(h)                     # one event for a step's evictions in a row
        else:
            self.events.append(("removed", [h], MEDIUM_DEVICE))

    def reset_prefix_cache(self):
        """Forget every cached block (vLLM's reset_prefix_cache). Pages held by sequences stay
        theirs, no longer findable by a new prompt; the KV tiers keep what they hold."""
        for h, page in self.cached.items():
            self.blocks[page].hash = None
            if self.snapshots is not None and self.tiers is None:
                self.snapshots.forget(h)          # the state at a block no lookup can find again
        self.cached.clear()
        if self.events is not None:
            self.events.append(("cleared",))

    def release(self, seq: Sequence):
        """Drop the sequence's references, each page once; its KV is gone from its view."""
        freed, hashes = [], []                    # for the tiers: one call a sequence, not a page
        tiers = self.tiers is not None
        for page in reversed(seq.pages):
            b = self.blocks[page]
            assert b.ref > 0, f"page {page} of {seq} has no reference"
            b.ref -= 1
            if b.ref == 0:
                self.free[page] = None            # to the LRU tail; stays cached if hashed
                if tiers:
                    freed.append(page)
                    hashes.append(b.hash)
        if freed:
            self.tiers.released(freed, hashes)
        seq.pages = []
        seq.num_computed_tokens = 0
        seq.num_committed_blocks = 0
        if seq.slot is not None:                  # its state is dropped with its KV
            self.free_slots.append(seq.slot)
            seq.slot = None
        if self.lora is not None:
            self.lora.drop(seq)
        if self.on_release is not None:
            self.on_release(seq)

    def check(self):
        """Invariants (tests): references are counted exactly, free pages are unreferenced."""
        for b in self.blocks:
            assert b.ref >= 0, b.id
            assert (b.ref == 0) == (b.id in self.free), (b.id, b.ref)
        for h, page in self.cached.items():
            assert self.blocks[page].hash == h
        assert len(set(self.free_slots)) == len(self.free_slots), self.free_slots
        assert all(0 <= s < self.num_slots for s in self.free_slots), self.free_slots
        if self.tiers is not None:
            self.tiers.check()
            self.tiers.check_places(self.free)
        if self.snapshots is not None:
            self.snapshots.check()
