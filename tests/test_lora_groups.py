"""The step's rows grouped by adapter slot (runtime/lora/groups.py), the metadata the LoRA kernels
tile: every row once, each slot's rows contiguous and in their step order."""
import numpy as np
import pytest

from infc.runtime.lora.groups import lora_groups


def test_rows_are_sorted_by_slot_stably_and_segments_bound_them():
    slots = np.array([3, 0, 1, 3, 3, 0, 2, 1, 3], np.int32)
    rows, segs = lora_groups(slots, 5)
    assert rows.dtype == np.int32 and segs.dtype == np.int32
    assert rows.tolist() == [1, 5, 2, 7, 6, 0, 3, 4, 8]
    assert segs.tolist() == [0, 2, 4, 5, 9, 9]            # slot 4 has no rows: an empty segment
    for s in range(5):
        assert (slots[rows[segs[s]:segs[s + 1]]] == s).all()


def test_an_empty_step_and_a_slot_outside_the_tables():
    rows, segs = lora_groups(np.zeros(0, np.int32), 3)
    assert rows.size == 0 and segs.tolist() == [0, 0, 0, 0]
    with pytest.raises(ValueError, match="slot 3 is outside the plan's 3 adapter slots"):
        lora_groups([0, 3], 3)
