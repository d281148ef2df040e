"""Speculative decoding inside the engine's steps: drafts proposed for decoding sequences, verified
as extra decode rows of the same step, accepted, rolled back (issue 43).

A verify step IS a decode step whose rows are the draft positions. A decoding sequence with last
token t at position p (t not in the KV yet) and drafts d_0..d_{k-1} runs k + 1 one-token Chunks
with its seq_id: [t] at p, then [d_j] at p + 1 + j. Row j's context length is p + j + 1 and it
attends to every key before it, the keys its earlier rows write in this very step included:
every plan writes the step's K/V for all its rows before attention reads any (the reference's
attention / qk_norm_rope_cache write the whole step first; on the GPU kv_write and the fused
qk-norm/rope/cache prologue are launches of their own before attention_cached, except in the
verify program (a speculative build's decode steps of 2..k + 1 <= 8 rows), whose decode
attention writes the cache itself: there each split also writes the keys of its sequence's
earlier rows that it reads, so none is read before it is written). phase_of says "decode", so
the GPU runs its decode programs, CUDA graphs and
sampler unchanged, data-parallel and tensor-parallel paths too. Known cost: each row reads its
sequence's context on its own, k + 1 reads of it where one would do, which grows with the
context length (a verify-aware attention kernel is future work).

The draft rows are placed after the step's ordinary rows (`add_rows`), so row b < B is still
batch entry b for every other part of the engine (masks, pending tokens, fed tokens).

Sampling: row j samples with RowSampling(step = the output index it samples), so its draw is the
one the non-speculative engine makes at that index; acceptance keeps the draws while they equal
the drafts (verify.accept_sampled: exact for greedy and for seeded sampling, with temperature,
top-k, top-p, min-p, logit bias, min_tokens' banned ids; each token's logprob is its own row's).
A draft model's sampled drafts whose q reached the host are verified by rejection sampling
instead (`_rejection`, from the rows' logits the engine keeps for them: keep_logits); the choice
and its measurements: docs/architecture.md, "Speculative decoding".

Proposers: n-gram (ngram.py), a draft model (draft_model.py: its own runner and pages, its
drafts made before the target's step, rolled back in settle with the target's), or an EAGLE-3
head or the checkpoint's MTP layer (eagle.py: the same, reading the target's hidden states,
which `observe` hands it after every target step).

Rollback (`settle`): with a drafts accepted, num_computed_tokens = p + a + 1 (the rejected rows'
K/V lie past it and are overwritten later), the pages past it go back (BlockManager.truncate),
and only accepted tokens join token_ids, so the prefix cache commits only them. Stops are checked
token by token by the engine; tokens after a stop are dropped.

Where speculation does not apply the sequence decodes as usual in the same step (the engine's
`eligible`: rows that need history, prompt logprobs still scoring; prefill chunks; nothing
proposed). Drafts never preempt anything: they are fitted after the scheduler's batch into the
token budget, the step's rows (max_num_seqs, and the runner's own max_seqs: one row is one of
its sequence slots) and the free pages, trimmed where those run short. With more running
sequences than disable_by_batch_size no drafts are made (infc/config.py: a placeholder until the
GPU measurement of verify cost against batch size sets it).
"""
from dataclasses import replace

import numpy as np

from .draft_model import DraftProposer, check_draft_runner  # noqa: F401 - the engine's door
from .ngram import NgramProposer
from ..prompt_logprobs import top_k
from ..runner import Sample
from ..sampling import logprobs_of
from .verify import accept_sampled, row_distribution, verify_sampled


def refuse_slot_caches(runner):
    """Plans with slot caches (a hybrid model's conv / recurrent state) cannot speculate: a
    rejected row would already have advanced the sequence's state, which has no rollback."""
    if not getattr(runner, "num_slots", 0):
        return
    names = []
    plan = getattr(runner, "plan", None)
    if isinstance(plan, dict):
        names = sorted(n for n, c in plan.get("caches", {}).items() if c.get("kind") == "slot")
    raise ValueError("speculative decoding is not supported for this model: it keeps per-sequence "
                     f"state in slot caches ({', '.join(names) or 'slot caches'}) that rejected "
                     "drafts would corrupt (rolling them back is not built)")


class Speculator:
    def __init__(self, config, max_model_len: int, max_rows: int | None = None, draft=None):
        """config: infc.config.SpeculativeConfig (method "ngram", "draft_model", "eagle3" or
        "mtp"); max_rows: the runner's rows a step (its max_seqs), None where it has no such
        limit; draft: the draft_model method's DraftProposer (draft_model.py), eagle3's and mtp's
        EagleProposer (eagle.py)."""
        if config.method not in ("ngram", "draft_model", "eagle3", "mtp"):
            raise ValueError(f"speculative method {config.method!r} is not supported yet")
        if (config.method in ("draft_model", "eagle3", "mtp")) != (draft is not None):
            raise ValueError(f"speculative method {config.method!r}: the draft model's or head's "
                             "proposer is needed by 'draft_model', 'eagle3' and 'mtp' (and only they take one)")
        self.config, self.k = config, config.num_speculative_tokens
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max, self.k) \
            if draft is None else None
        self.draft = draft
        self.max_model_len, self.max_rows = max_model_len, max_rows
        self.drafts: dict[int, list[int]] = {}     # seq_id -> its drafts in the step being run
        self.row_ids: dict[int, list[int]] = {}    # seq_id -> its k + 1 rows in the step
        self.verify_inputs: dict[int, tuple] = {}  # seq_id -> (its rows' logits, RowSamplings)
        self.layout: list = []                     # the step's chunks: (seq_id, start, n), by row

    def observe(self, runner):
        """After a target step: a head proposer (eagle.py) takes the step's hidden states."""
        if self.draft is not None and hasattr(self.draft, "observe"):
            self.draft.observe(self.layout, runner.outputs()["aux_hidden"])

    def begin(self):
        """A new step: drafts of a step that never settled (its sequences ended) are dropped."""
        self.drafts.clear()
        self.row_ids.clear()
        self.verify_inputs.clear()
        if self.draft is not None:
            self.draft.begin()

    def extend(self, batch: list, scheduler, bm, eligible, row_at=None) -> list:
        """The scheduler's batch with drafts: a decoding sequence's (seq, 1) becomes (seq, 1 + k)
        with pages for its k draft rows, k trimmed to the budget, the rows and the pages left.
        row_at(seq, output index) -> its RowSampling there (the draft model samples with it)."""
        if not batch or len(scheduler.running) > self.config.disable_by_batch_size:
            return batch
        budget = scheduler.max_num_batched_tokens - sum(n for _, n in batch)
        rows = min(scheduler.max_num_seqs, self.max_rows or scheduler.max_num_seqs) - len(batch)
        proposed = self._draft_model(batch, budget, rows, eligible, row_at) if self.draft else None
        out = []
        for seq, n in batch:
            k = self._cap(seq, min(budget, rows)) if n == 1 and seq.num_uncomputed == 1 else 0
            if k <= 0 or not eligible(seq):
                draft = []
            elif proposed is not None:
                draft = proposed.get(seq.seq_id, [])[:k]
            else:
                draft = self.proposer.propose(np.asarray(seq.token_ids, np.int64))[:k].tolist()
            # pages: what the sequence holds plus the free ones, never another's
            room = (len(seq.pages) + bm.num_free_pages) * bm.page_size - seq.num_computed_tokens - 1
            draft = draft[:max(0, room)]
            if draft and bm.grow(seq, 1 + len(draft)):
                self.drafts[seq.seq_id] = draft
                n = 1 + len(draft)
                budget -= len(draft)
                rows -= len(draft)
            elif proposed and seq.seq_id in proposed:
                self.draft.settle(seq, 0)           # proposed, not verified: the draft rolls back
            out.append((seq, n))
        return out

    def _draft_model(self, batch: list, budget: int, rows: int, eligible, row_at) -> dict:
        """The draft model's drafts for the batch's decoding sequences, each asked for the k that
        extend() will fit if every sequence before it gets all it asked for (a draft of the
        model's is as long as asked unless its own pages run short, so the asks are what fits)."""
        wants = []
        for seq, n in batch:
            if n == 1 and seq.num_uncomputed == 1 and eligible(seq):
                k = self._cap(seq, min(budget, rows))
                if k > 0:
                    wants.append((seq, k))
                    budget -= k
                    rows -= k
        return self.draft.propose(wants, row_at) if wants else {}

    def _cap(self, seq, room: int) -> int:
        """Drafts a sequence may verify now: its last row samples output index out + k, which must
        stay below max_tokens, and token num_tokens + k, below the context length."""
        k = min(self.k, room, self.max_model_len - seq.num_tokens - 1)
        if seq.params.max_tokens is not None:
            k = min(k, seq.params.max_tokens - seq.num_output_tokens - 1)
        return k

    def add_rows(self, batch: list, chunks: list, rows: list, row_at, chunk):
        """Append the draft rows of the batch's speculating sequences after the step's rows:
        chunk(seq_id, [d_j], start) for d_j at p + 1 + j, sampled as row_at(seq, output index)."""
        for b, (seq, _) in enumerate(batch):
            draft = self.drafts.get(seq.seq_id)
            if not draft:
                continue
            p, out = seq.num_computed_tokens, seq.num_output_tokens
            self.row_ids[seq.seq_id] = [b] + list(range(len(rows), len(rows) + len(draft)))
            for j, d in enumerate(draft):
                chunks.append(chunk(seq.seq_id, [d], p + 1 + j))
                rows.append(row_at(seq, out + 1 + j))

    def group(self, batch: list, samples: list) -> list:
        """The step's samples one a batch entry: a speculating sequence's, the list of its k + 1
        rows' samples (its own row, then its draft rows, in add_rows' order)."""
        out, at = list(samples[:len(batch)]), len(batch)
        for b, (seq, _) in enumerate(batch):
            draft = self.drafts.get(seq.seq_id)
            if draft:
                out[b] = [samples[b]] + list(samples[at:at + len(draft)])
                at += len(draft)
        return out

    # -- rejection sampling: draft-model rows whose q reached the host -----------------------------
    def rejects(self) -> bool:
        """Whether this step has sequences to verify by rejection sampling (their drafts' q is
        known): the engine then keeps the step's logits for them (keep_logits)."""
        return self.draft is not None and any(sid in self.draft.q for sid in self.drafts)

    def keep_logits(self, logits, rows: list):
        """The step's logits [rows, V] and RowSamplings: each rejecting sequence's k + 1 rows."""
        for sid, ids in self.row_ids.items():
            if sid in self.draft.q:
                self.verify_inputs[sid] = (logits[ids].copy(), [rows[i] for i in ids])

    def _rejection(self, seq, draft: list, q: list, samples: list) -> tuple[list, int]:
        """verify.verify_sampled over the rows' processed, filtered distributions p (the target's)
        and the q the draft drew from: (the samples to emit, drafts accepted). Its randomness is
        the request's own, (seed, output index of row 0, 1): a stream no draw of plain decoding
        or of the draft uses, used once (the next step's row 0 samples a later index). With every
        draft accepted the bonus token is row k's own draw from p_k (its (seed, index) stream, which
        no earlier step used: drafts reach only lower indices), so a draft equal to the target
        emits plain decoding's very tokens."""
        logits, rows = self.verify_inputs.pop(seq.seq_id)
        p = np.stack([row_distribution(x, r) for x, r in zip(logits, rows)])
        rng = np.random.default_rng((seq.seed, rows[0].step, 1))
        verdict = verify_sampled(p, draft, np.stack(q[:len(draft)]), rng)
        if verdict.accepted == len(draft):
            return [*self._emitted(seq, logits, draft), samples[-1]], len(draft)
        return self._emitted(seq, logits, verdict.tokens), verdict.accepted

    @staticmethod
    def _emitted(seq, logits, tokens: list) -> list:
        n = seq.params.logprobs
        out = []
        for x, tok in zip(logits, tokens):
            if n is None:
                out.append(Sample(tok))
            else:                               # each token's logprob is its own row's, as decoding's
                lp = logprobs_of(x)
                out.append(Sample(tok, float(lp[tok]), top_k(lp, n)))
        return out

    def settle(self, seq, samples: list, bm, metrics) -> list:
        """Accept a speculating sequence's rows and roll the rest back: the samples to emit,
        s_0..s_a. Exact match of the rows' own draws (verify.accept_sampled), or rejection
        sampling where the draft's q is known (_rejection)."""
        draft = self.drafts.pop(seq.seq_id)
        q = self.draft.q.get(seq.seq_id) if self.draft is not None else None
        if q is not None and seq.seq_id in self.verify_inputs and len(q) >= len(draft):
            emitted, accepted = self._rejection(seq, draft, q, samples)
        else:
            accepted = accept_sampled(samples, draft).accepted
            emitted = samples[:accepted + 1]
        seq.num_computed_tokens -= len(draft) - accepted   # p + 1 + k -> p + 1 + a
        bm.truncate(seq)
        if self.draft is not None:
            self.draft.settle(seq, accepted)
        metrics.drafts_verified(len(draft), accepted)
        return emitted


def merge_outputs(outputs: list):
    """One StepOutput of a sequence's tokens emitted in one step (in order), as one token's."""
    if len(outputs) == 1:
        return outputs[0]
    first, last = outputs[0], outputs[-1]
    logprobs = None if first.logprobs is None else [e for o in outputs for e in o.logprobs]
    return replace(last, token_ids=[t for o in outputs for t in o.token_ids],
                   text="".join(o.text for o in outputs), logprobs=logprobs,
                   prompt_logprobs=first.prompt_logprobs)
