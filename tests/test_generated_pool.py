"""tools/generated_pool.py: generated/'s kernel sources kept once, linked from each model's kernels/."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from generated_pool import pool  # noqa: E402


def _model(root: Path, name: str, kernels: dict) -> Path:
    k = root / name / "kernels"
    k.mkdir(parents=True)
    for f, text in kernels.items():
        (k / f).write_text(text)
    (root / name / "plan.json").write_text("{}")
    return k


def test_shared_kernels_are_one_file_and_read_the_same(tmp_path):
    a = _model(tmp_path, "a", {"gemv_1.py": "one", "gemv_2.py": "two"})
    b = _model(tmp_path, "b", {"gemv_1.py": "one", "gemv_3.py": "three"})
    assert pool(tmp_path) == (4, 0)
    store = tmp_path / "_kernels"
    assert sorted(p.name for p in store.iterdir()) == ["gemv_1.py", "gemv_2.py", "gemv_3.py"]
    for k in (a, b):
        assert all(f.is_symlink() for f in k.iterdir())
    assert (a / "gemv_1.py").read_text() == (b / "gemv_1.py").read_text() == "one"
    assert pool(tmp_path) == (0, 0)                      # again: nothing to do
    # a rebuild drops a kernel (its link) and writes a new one: pooled, the orphan removed
    (b / "gemv_3.py").unlink()
    (b / "gemv_4.py").write_text("four")
    assert pool(tmp_path) == (1, 1)
    assert sorted(p.name for p in store.iterdir()) == ["gemv_1.py", "gemv_2.py", "gemv_4.py"]


def test_other_bytes_under_one_id_fail(tmp_path):
    _model(tmp_path, "a", {"gemv_1.py": "one"})
    _model(tmp_path, "b", {"gemv_1.py": "not one"})
    with pytest.raises(SystemExit, match="other bytes"):
        pool(tmp_path)
