"""One step's metadata, built from the sequences' chunks: what every kernel reads besides
activations (see `step_metadata` in the plan and docs/kernels.md)."""
from dataclasses import dataclass
from itertools import chain

import numpy as np


@dataclass
class Chunk:
    seq_id: int
    tokens: list[int]      # the new tokens of this step
    start: int             # tokens of this sequence already in the KV cache


@dataclass
class StepMeta:
    T: int
    B: int
    phase: str
    tokens: np.ndarray         # [T] i32
    positions: np.ndarray      # [T] i32
    seq_starts: np.ndarray     # [B+1] i32
    context_lens: np.ndarray   # [B] i32, after this step
    last_rows: np.ndarray      # [B] i32
    slot_mapping: np.ndarray   # [T] i32
    block_tables: np.ndarray   # [B, max_pages] i32
    max_pages: int
    state_slots: np.ndarray | None = None   # [B] i32: each sequence's slot in the slot caches
                                            # (conv / recurrent state; read by plans with one)
    lora_slots: np.ndarray | None = None    # [T] i32: each token's adapter slot (LoRA plans;
                                            # None: every row slot 0, no adapter)
    scores: list | None = None   # [B] PromptScore | None: prompt logprobs asked of each chunk's
                                 # rows (runners with `row_logits` only; engine/prompt_logprobs.py)
    inputs: dict | None = None   # name -> [T, ...] f32: a plan's per-token inputs besides tokens
                                 # (a spec's `inputs:`, e.g. an EAGLE-3 head's target hidden states)


def phase_of(chunks: list[Chunk]) -> str:
    if all(c.start == 0 for c in chunks):
        return "prefill"
    if all(len(c.tokens) == 1 for c in chunks):
        return "decode"
    return "mixed"


def build_step(chunks: list[Chunk], pages_of, page_size: int, max_pages: int | None = None,
               slot_of=None) -> StepMeta:
    """pages_of(seq_id) -> the sequence's page list, already covering start + len(tokens);
    slot_of(seq_id) -> its state slot (plans with slot caches; None: every row slot 0).

    The per-token arrays are computed by numpy from the block tables, so the host's work per step
    is one pass over the chunks, not over their tokens or pages (a 256-sequence decode step and an
    8k-token prefill chunk cost the same few Python loops)."""
    B = len(chunks)
    tables = [pages_of(c.seq_id) for c in chunks]
    lens = np.fromiter((len(c.tokens) for c in chunks), np.int64, B)
    begins = np.fromiter((c.start for c in chunks), np.int64, B)
    npages = np.fromiter((len(t) for t in tables), np.int64, B)
    ends = begins + lens
    short = np.flatnonzero(npages * page_size < ends)
    if short.size:
        i = int(short[0])
        raise ValueError(f"sequence {chunks[i].seq_id}: {npages[i]} pages cannot hold {ends[i]} tokens")
    width = max_pages or int(npages.max(initial=1))      # B = 0: a data-parallel rank's empty step
    if npages.max(initial=0) > width:
        i = int(np.argmax(npages))
        raise ValueError(f"sequence {chunks[i].seq_id}: {npages[i]} pages, more than the "
                         f"{width} a block table row holds")
    bt = np.zeros((B, width), np.int32)
    bt[np.arange(width)[None, :] < npages[:, None]] = np.fromiter(
        chain.from_iterable(tables), np.int32, int(npages.sum()))        # row by row, as listed
    starts = np.zeros(B + 1, np.int64)
    np.cumsum(lens, out=starts[1:])
    T = int(starts[-1])
    row = np.repeat(np.arange(B), lens)                  # each token's sequence
    positions = np.arange(T) - starts[row] + begins[row]
    slots = bt[row, positions // page_size].astype(np.int64) * page_size + positions % page_size
    tokens = np.fromiter(chain.from_iterable(c.tokens for c in chunks), np.int32, T)
    i32 = lambda x: np.asarray(x, np.int32)  # noqa: E731
    return StepMeta(T, B, phase_of(chunks), tokens, i32(positions), i32(starts), i32(ends),
                    i32(starts[1:] - 1), i32(slots), bt, width,
                    i32([slot_of(c.seq_id) if slot_of else 0 for c in chunks]))


def pad_step(meta: StepMeta, T: int, page: int, page_size: int, rows: bool = False,
             slot: int = 0) -> StepMeta:
    """meta padded to T tokens with outputs nobody reads, writing only `page` (and state slot
    `slot`): rows=True appends T - meta.T one-token sequences (a decode step stays a decode
    step: use it where T is another rank's decode batch, so B stays within the runner's), else
    one sequence of T - meta.T tokens whose every page is `page` (its attention reads garbage
    that it wrote itself; its rows are finite and dropped). Data-parallel ranks pad their steps
    to the longest rank's T this way (pad_ranks): the collectives need the same T on every rank."""
    pad = T - meta.T
    if pad < 0:
        raise ValueError(f"cannot pad a step of {meta.T} tokens to {T}")
    if pad == 0:
        return meta
    i32 = lambda x: np.asarray(x, np.int32)  # noqa: E731
    n = pad if rows else 1                                   # new sequences
    need = 1 if rows else -(-pad // page_size)               # their block table width
    width = max(meta.max_pages, need)
    bt = np.zeros((meta.B + n, width), np.int32)
    bt[:meta.B, :meta.block_tables.shape[1]] = meta.block_tables
    bt[meta.B:, :need] = page
    slots = None if meta.state_slots is None else i32(np.concatenate([meta.state_slots, np.full(n, slot)]))
    lora = None if meta.lora_slots is None else i32(np.concatenate([meta.lora_slots, np.zeros(pad)]))
    if rows:
        positions, starts = np.zeros(pad), meta.T + np.arange(1, pad + 1)
        lens, last = np.ones(pad), meta.T + np.arange(pad)
    else:
        positions, starts, lens, last = np.arange(pad), [T], [pad], [T - 1]
    phase = ("decode" if meta.B == 0 else meta.phase) if rows else phase_of_padded(meta)
    return StepMeta(T, meta.B + n, phase,
                    i32(np.concatenate([meta.tokens, np.zeros(pad)])),
                    i32(np.concatenate([meta.positions, positions])),
                    i32(np.concatenate([meta.seq_starts, starts])),
                    i32(np.concatenate([meta.context_lens, lens])),
                    i32(np.concatenate([meta.last_rows, last])),
                    i32(np.concatenate([meta.slot_mapping, page * page_size + np.arange(pad) % page_size])),
                    bt, width, slots, lora)


def phase_of_padded(meta: StepMeta) -> str:
    """The phase of meta with a prompt-like pad sequence appended."""
    return "prefill" if meta.B == 0 or meta.phase == "prefill" else "mixed"


def pad_ranks(metas: list[StepMeta], page, page_size: int, slot: int = 0) -> list[StepMeta]:
    """Data-parallel ranks' steps made alike: padded to the longest T (one-token rows where every
    rank decodes, so each stays a decode step of at most the longest rank's B; else one pad
    sequence a rank) and under one phase (common_phase). page: the pad page, or each rank's."""
    T = max(1, max(m.T for m in metas))
    decode = all(m.phase == "decode" or m.B == 0 for m in metas)
    pages = page if isinstance(page, (list, tuple)) else [page] * len(metas)
    return common_phase([pad_step(m, T, p, page_size, rows=decode, slot=slot) for m, p in zip(metas, pages)])


def common_phase(metas: list[StepMeta]) -> list[StepMeta]:
    """Data-parallel ranks' steps (the same T) under one program: the phase they share, else
    "mixed", whose kernels run any chunks."""
    Ts = {m.T for m in metas}
    if len(Ts) > 1:
        raise ValueError(f"data-parallel ranks' steps must have the same T (pad them), got {sorted(Ts)}")
    phases = {m.phase for m in metas}
    phase = phases.pop() if len(phases) == 1 else "mixed"
    return [m if m.phase == phase else StepMeta(**{**vars(m), "phase": phase}) for m in metas]
