"""The logits_process kernel's arguments for a step's rows, on the host (numpy only).

Each row with processing (logits_process.needs_processing) becomes one program: its penalties,
and its entries, the distinct tokens it penalizes, biases or bans (merged: a token seen in the
output and biased is one entry), with its bitmask row where it has one. Rows with none are left
out: a step where no row has any launches nothing.
"""
from dataclasses import dataclass

import numpy as np

from ..engine.logits_process import bias_arrays, needs_processing, row_mask

IN_PROMPT, BANNED = 1, 2


@dataclass
class ProcessArgs:
    rows: np.ndarray          # i32 [R]
    rep: np.ndarray           # f32 [R]
    freq: np.ndarray          # f32 [R]
    pres: np.ndarray          # f32 [R]
    start: np.ndarray         # i32 [R + 1]
    tok: np.ndarray           # i32 [E]
    count: np.ndarray         # i32 [E]
    flag: np.ndarray          # i32 [E]
    bias: np.ndarray          # f32 [E]
    mask_row: np.ndarray      # i32 [R]
    masks: np.ndarray         # i32 [M, W]

    def arrays(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


_NO_ENTRIES = (np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.float32))


def row_entries(s, V: int) -> tuple:
    """(tok, count, flag, bias) of one row (RowSampling s), tokens distinct."""
    pen = s.penalties
    if pen is None and not s.banned and not s.params.logit_bias:
        return _NO_ENTRIES                  # a row with only a mask (a grammar's, allowed ids)
    bias_ids, bias = bias_arrays(s.params)
    banned = np.array([t for t in s.banned if 0 <= t < V], np.int32)
    pen_ids = pen.ids if pen is not None else np.zeros(0, np.int32)
    tok, inv = np.unique(np.concatenate([pen_ids, bias_ids, banned]).astype(np.int32), return_inverse=True)
    count = np.zeros(tok.size, np.int32)
    flag = np.zeros(tok.size, np.int32)
    b = np.zeros(tok.size, np.float32)
    n0, n1 = pen_ids.size, pen_ids.size + bias_ids.size
    if pen is not None:
        count[inv[:n0]] = pen.counts
        flag[inv[:n0]] |= np.where(pen.in_prompt, IN_PROMPT, 0).astype(np.int32)
    b[inv[n0:n1]] = bias
    flag[inv[n1:]] |= BANNED
    return tok, count, flag, b


def pack_rows(rows: list, V: int) -> ProcessArgs | None:
    """The kernel's arguments for the rows (RowSampling or None) that have processing; None if
    none has."""
    todo = [(b, s) for b, s in enumerate(rows) if s is not None and needs_processing(s)]
    if not todo:
        return None
    W = -(-V // 32)
    R = len(todo)
    rep, freq, pres = (np.ones(R, np.float32), np.zeros(R, np.float32), np.zeros(R, np.float32))
    sizes = np.zeros(R, np.int32)
    mask_row = np.full(R, -1, np.int32)
    parts, masked = [], []
    for r, (_, s) in enumerate(todo):
        if s.penalties is not None:
            rep[r], freq[r], pres[r] = s.penalties.repetition, s.penalties.frequency, s.penalties.presence
        e = row_entries(s, V)
        if e[0].size:
            parts.append(e)
            sizes[r] = e[0].size
        m = row_mask(s)
        if m is not None:
            mask_row[r] = len(masked)
            masked.append(m)
    start = np.zeros(R + 1, np.int32)
    np.cumsum(sizes, out=start[1:])
    cat = [np.concatenate([p[i] for p in parts]) for i in range(4)] if parts else list(_NO_ENTRIES)
    masks = np.empty((len(masked), W), np.int32)
    for i, m in enumerate(masked):          # one copy each into the step's block of masks
        masks[i] = m
    return ProcessArgs(np.array([b for b, _ in todo], np.int32), rep, freq, pres, start, *cat, mask_row, masks)
