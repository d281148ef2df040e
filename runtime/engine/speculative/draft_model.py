"""The draft-model proposer: a smaller model of the target's vocabulary (any family infc builds),
run by the same runtime in the same process on pages of its own, proposes k tokens a step by k
chained steps of its runner (issue 43; `--speculative-config '{"method": "draft_model", "model":
DIR or variant, "num_speculative_tokens": k}'`).

Each target sequence that speculates has a shadow Sequence here, in the draft's own
BlockManager (its pages, its prefix cache: n > 1 siblings and repeated prompts share the draft's
blocks as they share the target's). The shadow's token_ids are the target's true tokens only;
its KV may run ahead of them by the drafts fed in this step. A step's chain, for a sequence with
L true tokens of which the draft has computed C:
  forward 0: the catch-up chunk token_ids[C:L] at C..L-1 (one token after a step whose drafts
             were all accepted or the first rejected: the bonus token, two when all k were
             accepted, the whole prompt the first time), its last row sampling d_0;
  forward j: [d_{j-1}] at L + j - 1, sampling d_j (j = 1..k-1; d_{k-1} is never fed).
Every speculating sequence runs in the same forwards, so a step costs the draft k forwards
whatever the batch. The catch-up chunks share the engine's token budget
(max_num_batched_tokens): a sequence whose catch-up does not fit catches up part of the way and
proposes nothing this step (a long prompt's first draft waits for the draft's chunked prefill).

Rollback (`settle`, with a of the drafts accepted by the target): the draft's KV is valid up to
min(C', L + a), C' what it computed in the chain (positions L..L+a-1 hold d_0..d_{a-1}, now true
tokens); BlockManager.truncate gives back the pages past it, as the target's rollback does.
Only true tokens are ever hashed into the draft's prefix cache (BlockManager.commit hashes
min(computed, len(token_ids)) tokens, and token_ids never hold drafts).

Coupled draws (why the engine's exact-match rule, verify.accept_sampled, stays exact and pays):
the draft samples d_j with the sampling of the target's row at that output index, the same
RowSampling(params, seed, step = output index) the target's verify row draws with, run by the
draft's runner with the same sampler. The target's emitted token at every index is its own draw
there, whatever the draft proposed, so the output is plain decoding's token for token (greedy
and seeded) and has exactly the target's distribution; the draft only decides how many rows a
step verifies. A draft equal to the target draws exactly the target's tokens: acceptance 1, at
any temperature. docs/architecture.md ("Speculative decoding") compares this rule's acceptance
with rejection sampling's.

Pages: the draft's own. A sequence that cannot get them (the draft's cache is smaller, or full)
first evicts the shadows of sequences that do not speculate in this step (they recompute later,
from the draft's prefix cache where it still holds their blocks), then proposes fewer drafts,
then none. A target sequence's release (finish, abort, preemption: the target's BlockManager
hook) releases its shadow.
"""
from dataclasses import replace

from infc.compiler.contract.schema import plan_max_len

from ..block_manager import BlockManager
from ..runner import sample_rows
from ..sequence import Sequence
from ..step import Chunk, build_step
from .verify import row_distribution


def check_draft_runner(draft_runner, target_runner):
    """A draft the engine can verify: the target's vocabulary, no per-sequence state."""
    vd, vt = getattr(draft_runner, "vocab_size", None), getattr(target_runner, "vocab_size", None)
    if vd != vt:
        raise ValueError(f"speculative draft model: its vocabulary has {vd} tokens and the target's "
                         f"{vt}: a draft must share the target's vocabulary (its token ids are "
                         f"verified as the target's)")
    if getattr(draft_runner, "num_slots", 0):
        raise ValueError("speculative draft model: it keeps per-sequence state in slot caches "
                         "(a hybrid model), which rejected drafts would corrupt: choose a draft "
                         "with attention caches only")


class DraftProposer:
    def __init__(self, runner, max_num_batched_tokens: int, max_model_len: int,
                 enable_prefix_caching: bool = True):
        """runner: the draft's runner (CPU reference or CUDA: `execute(meta, rows)`, `num_pages`,
        `page_size`, optional `max_seqs` rows a step); max_model_len: the engine's."""
        self.runner = runner
        self.bm = BlockManager(runner.num_pages, runner.page_size, enable_prefix_caching)
        self.budget = max_num_batched_tokens
        self.max_rows = getattr(runner, "max_seqs", None)
        own = getattr(runner, "max_model_len", None) or plan_max_len(getattr(runner, "plan", None) or {})
        self.max_model_len = min(max_model_len, int(own))
        self.shadows: dict[int, Sequence] = {}        # target seq_id -> its shadow here
        self.proposed: dict[int, int] = {}            # seq_id -> its true length L, until settled
        # A runner whose logits reach the host (`forward`: the CPU reference) also gives the
        # distributions its drafts were drawn from, q, for rejection sampling (speculator.py)
        self.with_probs = callable(getattr(runner, "forward", None))
        self.q: dict[int, list] = {}                  # seq_id -> q of each draft (sampled rows)
        self.forwards = 0                             # the draft's forwards so far (tests, logs)

    # -- one step's drafts ------------------------------------------------------------------------
    def propose(self, wants: list, row_at) -> dict[int, list[int]]:
        """wants: (sequence, k) pairs, k >= 1 drafts wanted of each decoding sequence (in the
        step's order); row_at(seq, output index) -> the target's RowSampling there. Returns
        seq_id -> its drafts (at most k; none where the budget, rows or pages ran short)."""
        busy = {seq.seq_id for seq, _ in wants}
        budget, chunks, rows, chain = self.budget, [], [], []
        for seq, k in wants:
            if budget <= 0 or len(chunks) == (self.max_rows or len(wants)):
                break
            shadow, L = self._shadow(seq, budget, busy)
            if shadow is None:
                continue
            n = min(shadow.num_uncomputed, budget)
            caught_up = shadow.num_computed_tokens + n == L
            extra = min(k - 1, self.max_model_len - L) if caught_up else 0
            while not self.bm.grow(shadow, n + extra):     # the chunk and the k - 1 drafts fed
                if self._evict(busy):
                    continue
                if extra > 0:
                    extra -= 1
                    continue
                n = 0
                break
            if n == 0:
                continue
            C = shadow.num_computed_tokens
            chunks.append(Chunk(seq.seq_id, shadow.token_ids[C:C + n], C))
            rows.append(self._row(row_at, seq, shadow, seq.num_output_tokens) if caught_up else None)
            budget -= n
            if caught_up:
                chain.append((seq, shadow, 1 + extra, L))
        if not chunks:
            return {}
        samples, probs = self._forward(chunks, rows)
        drafts = {}
        for c, s, q in zip(chunks, samples, probs):
            shadow = self.shadows[c.seq_id]
            shadow.num_computed_tokens += len(c.tokens)
            self.bm.commit(shadow)                    # true tokens only: a catch-up is all known
            if s is not None:
                drafts[c.seq_id] = [s.token]
                if q is not None:
                    self.q[c.seq_id] = [q]
        for seq, _, _, L in chain:
            self.proposed[seq.seq_id] = L
        live = [x for x in chain if x[2] > 1]
        j = 1
        while live:                                   # forward j: feed d_{j-1}, sample d_j
            chunks = [Chunk(seq.seq_id, [drafts[seq.seq_id][-1]], L + j - 1) for seq, _, _, L in live]
            rows = [self._row(row_at, seq, sh, seq.num_output_tokens + j) for seq, sh, _, _ in live]
            for (seq, sh, _, _), s, q in zip(live, *self._forward(chunks, rows)):
                sh.num_computed_tokens += 1
                drafts[seq.seq_id].append(s.token)
                if q is not None and seq.seq_id in self.q:
                    self.q[seq.seq_id].append(q)
            j += 1
            live = [x for x in live if x[2] > j]
        return drafts

    def _shadow(self, seq, budget: int, busy: set):
        """seq's shadow with the target's true tokens (admitted with its cached prefix and pages
        for its first chunk when new), and L; (None, 0) when it cannot be placed."""
        shadow = self.shadows.get(seq.seq_id)
        L = len(seq.token_ids)
        if L > self.max_model_len:                    # the draft's context is shorter: no drafts
            return None, 0
        if shadow is not None:
            shadow.token_ids.extend(seq.token_ids[len(shadow.token_ids):])
            self.bm.commit(shadow)                    # the tokens accepted since its last step
            return shadow, L
        params = seq.params
        if params.logprobs is not None or params.prompt_logprobs is not None:
            params = replace(params, logprobs=None, prompt_logprobs=None)   # the draft's draws only
        shadow = Sequence(seq.seq_id, seq.request_id, seq.index, seq.token_ids, params, seq.seed)
        shadow.cache_salt = seq.cache_salt            # the draft's cached blocks are salted alike
        while self.bm.admit(shadow, budget) == 0:
            if not self._evict(busy):
                return None, 0
        self.shadows[seq.seq_id] = shadow
        return shadow, L

    @staticmethod
    def _row(row_at, seq, shadow, index: int):
        """The target's sampling at output index `index` (its seed, step, banned and allowed ids,
        logit bias), drawing without logprobs: the draft's tokens are coupled to the target's."""
        row = row_at(seq, index)
        row.params = shadow.params
        return row

    def _forward(self, chunks: list, rows: list) -> tuple[list, list]:
        """The rows' samples, and (with_probs) the distribution each sampled row drew from
        (None for greedy rows and where the runner's logits stay on the device)."""
        meta = build_step(chunks, lambda sid: self.shadows[sid].pages, self.bm.page_size)
        self.forwards += 1
        if not self.with_probs:
            return self.runner.execute(meta, rows), [None] * len(rows)
        logits = self.runner.forward(meta)
        return sample_rows(logits, rows), [
            row_distribution(logits[b], r) if r is not None and r.params.temperature > 0 else None
            for b, r in enumerate(rows)]

    def _evict(self, busy: set) -> bool:
        """Release the oldest shadow of a sequence not speculating in this step."""
        sid = next((s for s in self.shadows if s not in busy), None)
        if sid is None:
            return False
        self._drop(sid)
        return True

    # -- after the target's verification ----------------------------------------------------------
    def settle(self, seq, accepted: int):
        """The target accepted `accepted` of the drafts proposed for seq this step (0 too where it
        verified none of them): the draft's KV past them is rolled back."""
        L = self.proposed.pop(seq.seq_id, None)
        self.q.pop(seq.seq_id, None)
        shadow = self.shadows.get(seq.seq_id)
        if L is None or shadow is None:
            return
        shadow.num_computed_tokens = min(shadow.num_computed_tokens, L + accepted)
        self.bm.truncate(shadow)

    def begin(self):
        """A new step: drafts of a step that never settled are rolled back (none accepted)."""
        for sid in list(self.proposed):
            shadow = self.shadows.get(sid)
            if shadow is None:
                self.proposed.pop(sid)
            else:
                self.settle(shadow, 0)
        self.q.clear()

    def release(self, seq):
        """The target sequence gave its pages back (finished, aborted, preempted): so does its
        shadow (its full blocks stay in the draft's prefix cache)."""
        self._drop(seq.seq_id)

    def _drop(self, sid: int):
        self.proposed.pop(sid, None)
        self.q.pop(sid, None)
        shadow = self.shadows.pop(sid, None)
        if shadow is not None:
            self.bm.release(shadow)

    def held_pages(self) -> int:
        return self.bm.num_pages - self.bm.num_free_pages
