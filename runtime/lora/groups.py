"""A step's rows grouped by adapter slot (step metadata lora_rows / lora_segs, computed on the
host once a step from lora_slots): the LoRA kernels (codegen_templates/triton/_lora_tiles.j2)
give each program one tile of ONE slot's rows, gathered through lora_rows, as the segmented
(SGMV) kernels do, instead of every (row tile, slot) pair masking the rows of its slot: with 8
adapters taken in turn, a 16-row tile holds ~2 rows of each, and a program per (tile, slot) read
its B slice and ran its product for those 2 rows (the work times the slot count).

    lora_rows [T]      the rows in slot order (a stable sort: a prefill's run stays in order)
    lora_segs [S + 1]  slot s's rows are lora_rows[lora_segs[s]:lora_segs[s + 1]]; lora_segs[S] = T

Both are static-sized (T rows, S = max_loras + 1 slots), so a CUDA graph captures once: the
kernels' grids bound the tiles by min(T, cdiv(T, BLOCK_M) + S - 1) (each slot's last tile may be
partial), and a program past the step's tiles does nothing."""
import numpy as np


def lora_groups(slots, num_slots: int) -> tuple[np.ndarray, np.ndarray]:
    """(lora_rows, lora_segs) of a step's per-row adapter slots (i32 each)."""
    s = np.asarray(slots, np.int64)
    if s.size and (s.min() < 0 or s.max() >= num_slots):
        bad = int(s[(s < 0) | (s >= num_slots)][0])
        raise ValueError(f"lora_slots: slot {bad} is outside the plan's {num_slots} adapter slots "
                         f"(0 .. max_loras)")
    segs = np.zeros(num_slots + 1, np.int32)
    np.cumsum(np.bincount(s, minlength=num_slots), out=segs[1:])
    return np.argsort(s, kind="stable").astype(np.int32), segs


def num_slots(plan: dict) -> int:
    """S = max_loras + 1 of a LoRA plan (its lora_segs holds S + 1 entries)."""
    return int(plan["step_metadata"]["lora_segs"]["shape"][0]) - 1
