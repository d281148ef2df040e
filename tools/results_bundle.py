"""Pack a run folder's JSON results into one file, `<run>/results.jsonl.gz`, and unpack it again.

    python tools/results_bundle.py pack bench/results/RUN [RUN ...]
    python tools/results_bundle.py unpack bench/results/RUN [RUN ...]
    python tools/results_bundle.py compact bench/results/RUN [RUN ...]

A GPU session's run folder holds a JSON result per call and step, in nested per-call folders:
hundreds of small files, each taking at least a 4 KB block on a checkout (with their folders,
bench/results took 15 MB on disk for 7.9 MB of text). `pack` writes every JSON file under the run
into its bundle, one line per file (`{"file": path in the run folder, "result": its JSON}`, sorted
by path; entries already in the bundle stay), gzipped (a fifth of the plain JSON: 3.76 -> 0.74 MB
over every run; the plain bundles of 2026-12-06 filled the tree's 5 MiB), then removes those
files and the folders left empty. `unpack` writes each entry back to its path (the same JSON,
re-indented) and removes the bundle. `compact` rewrites an older bundle (a plain `results.jsonl`,
or one packed with spaced separators) in the current form. tools/results_index.py reads a bundle's
entries as the files they were.
"""
import argparse
import gzip
import json
import sys
from pathlib import Path, PurePosixPath

import results_index
from results_index import BUNDLE, PLAIN_BUNDLE


class PackError(Exception):
    """A file that cannot be packed or unpacked: not JSON, already packed, an unsafe path."""


def _entry_path(run: Path, file: str) -> Path:
    p = PurePosixPath(file)
    if p.is_absolute() or ".." in p.parts or not p.parts:
        raise PackError(f"{run / BUNDLE}: entry {file!r} is not a path inside the run folder")
    return run.joinpath(*p.parts)


def line(path: str, result) -> str:
    """A bundle's line: compact separators (a tenth of the bytes of json.dumps' spaced ones; the
    tree's bench/results/ budget is on disk)."""
    return json.dumps({"file": path, "result": result}, ensure_ascii=False, separators=(",", ":")) + "\n"


def write_bundle(bundle: Path, text: str):
    """The bundle's lines, gzipped with no timestamp (the same results, the same bytes), whole
    before it replaces what was there."""
    tmp = bundle.with_name(bundle.name + ".tmp")
    tmp.write_bytes(gzip.compress(text.encode(), compresslevel=9, mtime=0))
    tmp.replace(bundle)


def existing(run: Path) -> Path | None:
    """The run's bundle: the gzipped one, else an older plain one, else None."""
    return next((b for b in (run / BUNDLE, run / PLAIN_BUNDLE) if b.exists()), None)


def compact(run: Path) -> bool:
    """Rewrite a run's bundle in the current form (compact lines, gzipped: a plain or spaced one
    from before); whether it changed."""
    old = existing(run)
    if old is None:
        return False
    text = results_index.bundle_text(old)
    out = "".join(line(e["file"], e["result"]) for e in (json.loads(x) for x in text.splitlines() if x.strip()))
    if old.name == BUNDLE and out == text:
        return False
    write_bundle(run / BUNDLE, out)
    if old.name != BUNDLE:
        old.unlink()
    return True


def pack(run: Path) -> int:
    """Bundle every JSON file under `run`; the number packed."""
    if not run.is_dir():
        raise PackError(f"{run}: not a run folder")
    old, bundle = existing(run), run / BUNDLE
    entries = dict(results_index.bundle_entries(old)) if old else {}
    files = sorted(run.rglob("*.json"))
    for f in files:
        rel = f.relative_to(run).as_posix()
        if rel in entries:
            raise PackError(f"{f}: already in {bundle} (unpack the run first to replace it)")
        try:
            entries[rel] = json.loads(f.read_text())
        except (ValueError, UnicodeDecodeError) as err:
            raise PackError(f"{f}: not JSON ({err}); nothing packed") from None
    if not files:
        return 0
    write_bundle(bundle, "".join(line(k, entries[k]) for k in sorted(entries)))
    if old is not None and old != bundle:  # an older plain bundle's entries are in the new one
        old.unlink()
    for f in files:
        f.unlink()
    for d in sorted((d for d in run.rglob("*") if d.is_dir()), key=lambda d: -len(d.parts)):
        if not any(d.iterdir()):
            d.rmdir()
    return len(files)


def unpack(run: Path) -> int:
    """Write each entry of the run's bundle back to its file and remove the bundle."""
    bundle = existing(run)
    if bundle is None:
        raise PackError(f"{run}: no {BUNDLE} to unpack")
    entries = list(results_index.bundle_entries(bundle))
    targets = [(_entry_path(run, file), result) for file, result in entries]
    for path, _ in targets:
        if path.exists():
            raise PackError(f"{path}: exists; nothing unpacked")
    for path, result in targets:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    bundle.unlink()
    return len(targets)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="results_bundle.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=["pack", "unpack", "compact"])
    ap.add_argument("runs", nargs="+", type=Path, help="run folders under bench/results/")
    a = ap.parse_args(argv)
    try:
        for run in a.runs:
            if a.action == "compact":
                changed = compact(run)
                print(f"{run}: {'compacted' if changed else 'unchanged'}")
                continue
            n = (pack if a.action == "pack" else unpack)(run)
            print(f"{run}: {a.action}ed {n} results")
    except (PackError, results_index.BundleError) as err:
        print(f"results_bundle.py: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
