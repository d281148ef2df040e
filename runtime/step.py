"""One step's metadata, built from the sequences' chunks: what every kernel reads besides
activations (see `step_metadata` in the plan and codegen_templates/KERNELS.md)."""
from dataclasses import dataclass

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


def phase_of(chunks: list[Chunk]) -> str:
    if all(c.start == 0 for c in chunks):
        return "prefill"
    if all(len(c.tokens) == 1 for c in chunks):
        return "decode"
    return "mixed"


def build_step(chunks: list[Chunk], pages_of, page_size: int, max_pages: int | None = None,
               slot_of=None) -> StepMeta:
    """pages_of(seq_id) -> the sequence's page list, already covering start + len(tokens);
    slot_of(seq_id) -> its state slot (plans with slot caches; None: every row slot 0)."""
    tokens, positions, starts, ctx, last, slots = [], [], [0], [], [], []
    tables = []
    for c in chunks:
        pages = pages_of(c.seq_id)
        n = len(c.tokens)
        end = c.start + n
        if len(pages) * page_size < end:
            raise ValueError(f"sequence {c.seq_id}: {len(pages)} pages cannot hold {end} tokens")
        tokens += c.tokens
        positions += range(c.start, end)
        slots += [pages[p // page_size] * page_size + p % page_size for p in range(c.start, end)]
        starts.append(starts[-1] + n)
        ctx.append(end)
        last.append(starts[-1] - 1)
        tables.append(pages)
    width = max_pages or max(len(t) for t in tables)
    bt = np.zeros((len(chunks), width), np.int32)
    for i, t in enumerate(tables):
        bt[i, : len(t)] = t
    i32 = lambda x: np.asarray(x, np.int32)  # noqa: E731
    return StepMeta(len(tokens), len(chunks), phase_of(chunks), i32(tokens), i32(positions),
                    i32(starts), i32(ctx), i32(last), i32(slots), bt, width,
                    i32([slot_of(c.seq_id) if slot_of else 0 for c in chunks]))
