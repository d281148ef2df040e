"""The block hashes of the last prompts admitted, for prompts that begin as one of them did.

A prompt's block hashes are sha256 over its tokens from the first (block_manager.py), made a
block at a time by a Python loop: a 16k-token prompt's 1,024 blocks took ~0.75 ms of the
engine thread on the build machine, on every admission, while the device waits for the step.
Most long prompts begin as a recent one did: a warm prefix hit re-sends its prefix, a chat's
next turn its history, an agent its tools and context. Block i's hash depends only on the tokens
up to its end and the sequence's owner (its adapter, its cache salt), so where a new prompt's
tokens equal an earlier prompt's of the same owner up to some full block, its hashes up to there
are that prompt's: found by one array comparison, and the running hasher brought to that block
by one update over those tokens' bytes.

The prompts are found by their first block's tokens and their owner: a prompt whose first block
or owner differs from every kept one shares no hash with them. The most recent prompt with that
first block and owner is kept (RECENT_PROMPT_HASHES of them in all, the least recently admitted
dropped first): a shared system prompt, then each new prompt compared with the last.
"""
from collections import OrderedDict

import numpy as np


class RecentHashes:
    def __init__(self, capacity: int, page_size: int):
        self.capacity, self.page_size = capacity, page_size
        self.prompts: OrderedDict[tuple, tuple[np.ndarray, list[bytes]]] = OrderedDict()
        self.reused_blocks = 0                 # blocks whose hash was taken, not computed

    def _key(self, owner, tokens: np.ndarray) -> tuple:
        return owner, tokens[: self.page_size].tobytes()

    def reuse(self, owner, tokens: np.ndarray, hashes: list[bytes], num_blocks: int) -> int:
        """Append to the (empty) hashes the first of num_blocks block hashes of the prompt whose
        tokens (int64, from token 0) begin as a kept prompt of the same owner's did (its adapter
        and cache salt: block_manager._owner); how many."""
        kept = self.prompts.get(self._key(owner, tokens)) if self.capacity else None
        if kept is None:
            return 0
        prev, prev_hashes = kept
        m = min(len(prev), len(tokens))
        differ = np.flatnonzero(prev[:m] != tokens[:m])
        same = int(differ[0]) if len(differ) else m
        k = min(same // self.page_size, num_blocks, len(prev_hashes))
        hashes.extend(prev_hashes[:k])
        self.reused_blocks += k
        return k

    def remember(self, owner, tokens: np.ndarray, hashes: list[bytes]):
        """Keep a prompt's tokens (its whole blocks') and their hashes (a copy: ~3 us at 1,024)."""
        if not self.capacity or len(tokens) < self.page_size:
            return
        key = self._key(owner, tokens)
        self.prompts[key] = (tokens, hashes[: len(tokens) // self.page_size])
        self.prompts.move_to_end(key)
        while len(self.prompts) > self.capacity:
            self.prompts.popitem(last=False)
