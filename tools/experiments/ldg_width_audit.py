"""Narrow global loads in loops (CPU, no GPU): each cubin's loop bodies (w4_sass_count.loops) with
their LDGs counted by width. A hot loop loading 8- or 16-bit elements one at a time is usually a
mask or an index the compiler could not see as contiguous (bench/NOTES.md, issue 45: the packed
codes' `2 * j < k_end` cost the grouped MXFP4 expert GEMMs their cp.async pipelining), or a
strided read by design (_mx_fma.j2's x columns, from L1).

    .venv/bin/python tools/experiments/ldg_width_audit.py .cache/gpu/gpt-oss-20b-art/bin/*.cubin [--min 4]

Prints, widest offenders first: narrow loads in the loop, the cubin, the loop's instructions, its
LDGs by width (U8 / S8 / U16 / S16 narrow; 32, 64, 128 bits).
"""
import argparse
import re
import subprocess
from pathlib import Path

from w4_sass_count import BIN, loops

NARROW = ("U8", "S8", "U16", "S16")


def ldg_width(op: str) -> str:
    m = re.search(r"\bLDG((?:\.[A-Z0-9_]+)*)", op)
    if not m:
        return ""
    mods = m.group(1).split(".")
    return next((w for w in NARROW + ("128", "64") if w in mods), "32")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("cubins", nargs="+")
    ap.add_argument("--min", type=int, default=4, help="narrow loads in a loop to report it")
    a = ap.parse_args()
    rows, seen = [], set()
    for cubin in map(Path, a.cubins):
        if cubin.name in seen:                      # a kernel's name holds its source hash
            continue
        seen.add(cubin.name)
        text = subprocess.run([str(BIN / "cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True).stdout
        for n, widths in loops(text, 32, key=ldg_width):
            widths.pop("", None)
            narrow = sum(widths[w] for w in NARROW)
            if narrow >= a.min:
                rows.append((narrow, cubin.name, n, dict(widths)))
    for narrow, name, n, widths in sorted(rows, key=lambda r: (-r[0], r[1])):
        print(f"{narrow:4d} narrow  {name}  loop of {n}  LDG {widths}")


if __name__ == "__main__":
    main()
