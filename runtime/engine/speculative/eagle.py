"""The EAGLE-3 proposer: a head that reads the target's hidden states proposes k tokens a step by
k chained steps of its own small plan (issue 43; `--speculative-config '{"method": "eagle3",
"model": HEAD_DIR, "num_speculative_tokens": k}'`; the head is specs/eagle3.yaml).

What the head reads: the target plan's output aux_hidden (compiler/passes/capture_hidden.py), the
residual stream entering three of its layers at every row the target computed. After each target
step the engine hands those rows over (`observe`), kept by position for each sequence.

The head runs on pages of its own, one shadow sequence per target sequence, shifted by one token:
head position t combines the target's state at t with the embedding of token t + 1 and predicts
token t + 2. A target sequence of L true tokens (the last one not yet in the target's KV, so the
target computed positions 0..L-2) has head positions 0..L-2 to compute. A step's chain, for a
sequence whose head computed C positions:
  forward 0: the catch-up chunk, head positions C..L-2 (tokens token_ids[C+1:L], the target's
             hidden rows there as input `aux`), its last row's argmax d_0;
  forward j: [d_{j-1}] at head position L - 2 + j, its input the head's own output hidden state
             of the row before (input `hidden`), argmax d_j (j = 1..k-1).
Rollback (`settle`): head positions past L - 2 were computed from the head's own hidden states,
not the target's, so whatever was accepted they are recomputed next step from the target's rows
(the head's KV is cut back to L - 1 positions, its pages past them returned).

Drafts are the head's argmax, mapped from its draft vocabulary to target ids (j + d2t[j]): a
deterministic proposer, so the engine's exact-match rule (verify.accept_sampled) keeps the
output token for token the target's own, greedy or sampled (the drafts only decide how many rows
a step verifies).

A catch-up longer than the step's token budget goes part of the way and proposes nothing that
step. The target's rows are kept until the head consumes them: a sequence that never speculates
(a grammar's, a penalty's) keeps its rows until it ends (3H floats a token: a known cost).

The same proposer runs a checkpoint's MTP layer (`--speculative-config '{"method": "mtp", ...}'`:
the plan of its family spec's `mtp:` section, inputs `aux` [T, H] the target's last hidden state
and `hidden` its own, d2t zeros): the same shift by one token, chain and rollback.

Where the target's hidden rows for a position the head needs are missing (a prefix-cache hit
computed them in another request; the head's own cache keeps no prefix), the sequence proposes
nothing (it decodes as usual), and the head drops its shadow.
"""
import numpy as np

from ..block_manager import BlockManager
from ..sequence import Sequence
from ..step import Chunk, build_step


class EagleProposer:
    def __init__(self, runner, d2t, max_num_batched_tokens: int, max_model_len: int):
        """runner: the head's runner (a CPURunner of the eagle3 plan, `forward(meta)`, or a
        CudaRunner, `logits(meta)`: the step's [B, Vd] logits on the host; then `outputs()`);
        d2t: [Vd] offsets, target id = draft id + d2t[draft id]."""
        self.runner = runner
        self._logits = getattr(runner, "forward", None) or runner.logits
        plan = runner.plan
        self.H = int(plan["inputs"]["hidden"]["shape"][1])
        self.W = int(plan["inputs"]["aux"]["shape"][1])
        d2t = np.asarray(d2t, np.int64)
        self.to_target = np.arange(d2t.shape[0], dtype=np.int64) + d2t
        V = plan["config"]["V"]
        if self.to_target.min(initial=0) < 0 or self.to_target.max(initial=0) >= V:
            raise ValueError(f"speculation head: d2t maps draft ids outside the target's vocabulary "
                             f"[0, {V})")
        self.bm = BlockManager(runner.num_pages, runner.page_size, enable_prefix_caching=False)
        self.budget = max_num_batched_tokens
        self.max_rows = getattr(runner, "max_seqs", None)
        self.max_model_len = max_model_len
        self.shadows: dict[int, Sequence] = {}
        self.hiddens: dict[int, dict[int, np.ndarray]] = {}   # seq_id -> position -> [W] row
        self.proposed: dict[int, int] = {}                     # seq_id -> head positions true
        self.q: dict = {}                                      # no draft distributions (argmax)
        self.forwards = 0

    # -- the target's hidden states ---------------------------------------------------------------
    def observe(self, chunks: list, aux: np.ndarray):
        """After a target step: chunks (seq_id, start, n) in the step's row order, aux its
        [T, W] output. Later rows of a position replace earlier ones (a rejected draft row's
        position is computed again, with the true token, by a later step)."""
        if aux.ndim != 2 or aux.shape[1] != self.W:
            raise ValueError(f"speculation head: the target's aux_hidden is {list(aux.shape)}, the head "
                             f"reads [T, {self.W}] (a head for another target, or other layers?)")
        at = 0
        for sid, start, n in chunks:
            rows = self.hiddens.setdefault(sid, {})
            for j in range(n):
                rows[start + j] = aux[at + j]
            at += n

    # -- one step's drafts ------------------------------------------------------------------------
    def propose(self, wants: list, row_at=None) -> dict[int, list[int]]:
        """wants: (target sequence, k) pairs; returns seq_id -> its drafts (at most k)."""
        budget, live = self.budget, []
        chunks, aux_rows = [], []
        for seq, k in wants:
            if budget <= 0 or len(chunks) == (self.max_rows or len(wants)):
                break
            Lh = len(seq.token_ids) - 1              # head positions the target's rows cover
            shadow = self.shadows.get(seq.seq_id)
            if shadow is None:
                shadow = Sequence(seq.seq_id, seq.request_id, seq.index, [], seq.params, seq.seed)
                self.shadows[seq.seq_id] = shadow
            C = shadow.num_computed_tokens
            rows = self.hiddens.get(seq.seq_id, {})
            if any(p not in rows for p in range(C, Lh)):
                self._drop(seq.seq_id)               # its history is gone: no drafts, ever again
                continue
            # a catch-up longer than the budget goes part of the way, proposing nothing this step
            n = min(Lh - C, budget)
            caught_up = C + n == Lh
            if n <= 0 or (caught_up and Lh + k - 1 > self.max_model_len) \
                    or not self.bm.grow(shadow, n + (k - 1 if caught_up else 0)):
                continue
            chunks.append(Chunk(seq.seq_id, list(seq.token_ids[C + 1:C + n + 1]), C))
            aux_rows.append(np.stack([rows[p] for p in range(C, C + n)]))
            live.append((seq, shadow, k if caught_up else 0, Lh))
            budget -= n
        if not chunks:
            return {}
        aux = np.concatenate(aux_rows)
        tokens, hidden = self._forward(chunks, aux, np.zeros((len(aux), self.H), np.float32))
        drafts = {}
        for (seq, shadow, k, Lh), c, t in zip(live, chunks, tokens):
            shadow.num_computed_tokens += len(c.tokens)
            rows = self.hiddens[seq.seq_id]
            for p in range(c.start, c.start + len(c.tokens)):   # consumed
                rows.pop(p, None)
            if k:
                self.proposed[seq.seq_id] = Lh
                drafts[seq.seq_id] = [int(t)]
        j, chain = 1, [(x, h) for x, h in zip(live, hidden) if x[2] > 1]
        while chain:                                  # forward j: [d_{j-1}] with its own hidden
            chunks = [Chunk(seq.seq_id, [drafts[seq.seq_id][-1]], Lh - 1 + j)
                      for (seq, _, _, Lh), _ in chain]
            hid = np.stack([h for _, h in chain])
            tokens, hidden = self._forward(chunks, np.zeros((len(chunks), self.W), np.float32), hid)
            nxt = []
            for ((seq, shadow, k, Lh), _), t, h in zip(chain, tokens, hidden):
                shadow.num_computed_tokens += 1
                drafts[seq.seq_id].append(int(t))
                if k > j + 1:
                    nxt.append(((seq, shadow, k, Lh), h))
            chain, j = nxt, j + 1
        return drafts

    def _forward(self, chunks: list, aux: np.ndarray, hidden: np.ndarray):
        """One head step: each chunk's last row's draft (target ids) and output hidden state."""
        meta = build_step(chunks, lambda sid: self.shadows[sid].pages, self.bm.page_size)
        meta.inputs = {"aux": aux, "hidden": hidden}
        self.forwards += 1
        logits = self._logits(meta)
        out = self.runner.outputs()["hidden_out"]
        return self.to_target[np.argmax(logits, axis=-1)], out

    # -- after the target's verification ----------------------------------------------------------
    def settle(self, seq, accepted: int):
        """Head positions past the target's rows go (recomputed next step from the target's own);
        the target's rows the head has consumed are dropped."""
        Lh = self.proposed.pop(seq.seq_id, None)
        shadow = self.shadows.get(seq.seq_id)
        if Lh is None or shadow is None:
            return
        shadow.num_computed_tokens = min(shadow.num_computed_tokens, Lh)
        self.bm.truncate(shadow)
        rows = self.hiddens.get(seq.seq_id)
        if rows:
            for p in [p for p in rows if p < Lh]:
                del rows[p]

    def begin(self):
        for sid in list(self.proposed):
            shadow = self.shadows.get(sid)
            if shadow is None:
                self.proposed.pop(sid)
            else:
                self.settle(shadow, 0)

    def release(self, seq):
        self._drop(seq.seq_id)

    def _drop(self, sid: int):
        self.proposed.pop(sid, None)
        self.hiddens.pop(sid, None)
        shadow = self.shadows.pop(sid, None)
        if shadow is not None:
            self.bm.release(shadow)

    def held_pages(self) -> int:
        return self.bm.num_pages - self.bm.num_free_pages
