"""Keep in a carry folder only the cubins one tuning table's plans name (tests/gpu/carry.sh --table).

    python tests/gpu/carry_table.py .cache/carry h200

prepare.py builds each artifact for both tables (bin/ holds the H100's and the H200's cubins, the
plan is the last table's) so that one carry serves either card. When the card is known (a call
that names nvidia-h200), the other table's cubins are dead weight against the device tool's
64 MiB, which counts the checkout's files as they lie on disk (~51 MiB of 4 KiB blocks at
c4b8fadb, ~44 MiB since generated/'s kernels are pooled): for qwen3-4b's artifact 24 of 106
files. An artifact rendered for another table (a tiny
model whose plan prepare.py left on the H100's) is kept whole: on the card it re-renders from
its own cubins (tests/gpu/rerender.py), which this cannot know it will not need.
"""
import gzip
import json
import sys
from pathlib import Path


def plan_text(art: Path) -> str | None:
    for name in ("plan.json", "plan.rank0.json"):
        if (art / name).exists():
            return (art / name).read_text()
        if (art / (name + ".gz")).exists():
            return gzip.open(art / (name + ".gz"), "rt").read()
    return None


def keep_table(carry: Path, table: str) -> tuple[int, int]:
    """Rewrite each artifact's bin.list to the cubins its `table` plan names; drop the pool's
    files no list names. Returns (files kept, files dropped) in the pool."""
    keep = set()
    for listing in carry.rglob("bin.list"):
        names = listing.read_text().split()
        text = plan_text(listing.parent)
        if text is None or json.loads(text)["build"].get("gpu") != table:
            keep |= set(names)                  # another table's plan, or none: kept whole
            continue
        named = [n for n in names if n.rsplit(".", 1)[0] in text]
        listing.write_text("".join(n + "\n" for n in named))
        keep |= set(named)
    pool = carry / "binpool"
    dropped = [f for f in pool.iterdir() if f.name.removesuffix(".gz") not in keep]
    for f in dropped:
        f.unlink()
    return len(list(pool.iterdir())), len(dropped)


if __name__ == "__main__":
    kept, dropped = keep_table(Path(sys.argv[1]), sys.argv[2])
    print(f"[carry] {sys.argv[2]} table only: {kept} pool files kept, {dropped} dropped")
