"""Keep each kernel source of generated/ once: generated/_kernels/<id>.py, linked from every
generated/<model>/kernels/ that renders it (`make generated` runs this after the builds).

    python tools/generated_pool.py          # pool the kernels, drop the pool's unlinked files

A kernel's id is the hash of its source, so the 74 committed builds share a third of their 3,200
kernel files; as files of their own they took ~38 MB of the checkout on disk (4 KB blocks), which
every GPU call carries beside its artifacts under the device tool's 64 MB (tests/gpu/carry.sh).
A link is one inode and no block. Reading a model's kernels/ follows the links (the build itself
rewrites a file only when its source changed, and drops the links of kernels it no longer renders).
"""
import os
import sys
from pathlib import Path

GENERATED = Path(__file__).resolve().parents[1] / "generated"
POOL = GENERATED / "_kernels"


def pool(generated: Path = GENERATED) -> tuple[int, int]:
    """Move every kernel source under generated/*/kernels/ into the pool (or drop it where the pool
    holds the same bytes) and link it back; remove pool files no model links. Returns (links made,
    pool files removed). A pool file with other bytes under the same name is an error: ids are
    hashes of the source."""
    store = generated / POOL.name
    store.mkdir(exist_ok=True)
    linked, made = set(), 0
    for kdir in sorted(generated.glob("*/kernels")):
        for f in sorted(kdir.iterdir()):
            target = store / f.name
            if f.is_symlink():
                if f.resolve() != target.resolve() or not target.exists():
                    raise SystemExit(f"{f}: a link that is not to {target}")
                linked.add(f.name)
                continue
            data = f.read_bytes()
            if not target.exists():
                target.write_bytes(data)
            elif target.read_bytes() != data:
                raise SystemExit(f"{f}: other bytes than {target} under the same id")
            f.unlink()
            f.symlink_to(os.path.relpath(target, kdir))
            linked.add(f.name)
            made += 1
    removed = 0
    for f in sorted(store.iterdir()):
        if f.name not in linked:
            f.unlink()
            removed += 1
    return made, removed


if __name__ == "__main__":
    made, removed = pool(Path(sys.argv[1]) if len(sys.argv) > 1 else GENERATED)
    print(f"generated/_kernels: {made} files linked, {removed} unlinked pool files removed")
