"""tests/gpu/carry_table.py: a carry folder keeps only the cubins the named table's plans use;
another table's artifact is kept whole, and a cubin two artifacts share stays."""
import gzip
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
from carry_table import keep_table  # noqa: E402


def _artifact(carry: Path, rel: str, gpu: str, kernels: list[str], bins: list[str], zipped: bool):
    art = carry / rel
    art.mkdir(parents=True)
    plan = json.dumps({"build": {"gpu": gpu}, "kernels": {k: {"cubin": f"{k}.cubin"} for k in kernels}})
    if zipped:
        with gzip.open(art / "plan.json.gz", "wt") as f:
            f.write(plan)
    else:
        (art / "plan.json").write_text(plan)
    (art / "bin.list").write_text("".join(b + "\n" for b in bins))
    for b in bins:
        (carry / "binpool" / (b + ".gz")).write_bytes(b"x")


def test_keeps_the_tables_cubins_and_other_tables_whole(tmp_path):
    carry = tmp_path / "carry"
    (carry / "binpool").mkdir(parents=True)
    _artifact(carry, "artifacts/a", "h200", ["gemv_aa", "gemm_bb"],
              ["gemv_aa.cubin", "gemv_aa.json", "gemm_bb.cubin", "gemv_cc.cubin", "gemv_cc.json"], zipped=True)
    _artifact(carry, "gpu/tiny-art", "h100", ["gemv_dd"], ["gemv_dd.cubin", "gemv_ee.cubin"], zipped=False)
    _artifact(carry, "gpu/b-art", "h200", ["gemm_bb"], ["gemm_bb.cubin", "gemm_ff.cubin"], zipped=False)
    kept, dropped = keep_table(carry, "h200")
    pool = sorted(p.name for p in (carry / "binpool").iterdir())
    assert pool == ["gemm_bb.cubin.gz", "gemv_aa.cubin.gz", "gemv_aa.json.gz", "gemv_dd.cubin.gz", "gemv_ee.cubin.gz"]
    assert (kept, dropped) == (5, 3)
    assert (carry / "artifacts/a/bin.list").read_text().split() == ["gemv_aa.cubin", "gemv_aa.json", "gemm_bb.cubin"]
    assert (carry / "gpu/tiny-art/bin.list").read_text().split() == ["gemv_dd.cubin", "gemv_ee.cubin"]
    assert (carry / "gpu/b-art/bin.list").read_text().split() == ["gemm_bb.cubin"]
