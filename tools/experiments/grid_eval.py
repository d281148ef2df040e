"""What does evaluating a launch grid cost the CUDA runner per launch? Python's `eval` of the
plan's text (the runner before issue 39) against compiler/safe_eval.compile_int (now), on every
grid of the committed generated/*/plan.json at a few step sizes, after checking they agree.

    python bench/experiments/grid_eval.py [--reps 20]

CPU only: the runner evaluates a kernel's three grid formulas for every launch of an eager step
(prefill, mixed; decode replays graphs), so this is host time added to or saved from a step.
"""
import argparse
import glob
import json
import time
from pathlib import Path

from infc.compiler.contract.safe_eval import INT_FUNCS, compile_int

ROOT = Path(__file__).resolve().parents[2]
STEPS = [(1, 1), (7, 3), (256, 256), (8192, 64), (1000, 999)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    grids = []
    for p in sorted(glob.glob(str(ROOT / "generated" / "*" / "plan.json"))):
        for m in json.loads(Path(p).read_text())["kernels"].values():
            grids.append(list(m["grid"]) + [1] * (3 - len(m["grid"])))
    before = [[compile(str(e), "<grid>", "eval") for e in g] for g in grids]
    after = [[compile_int(e) for e in g] for g in grids]
    dims_list = [{"T": t, "B": b, "N": 4096, "G": 2 * t} for t, b in STEPS]
    for dims in dims_list:
        env = {**INT_FUNCS, **dims}
        for old, new in zip(before, after):
            assert [int(eval(c, env)) for c in old] == [f(dims) for f in new]    # noqa: S307

    def run_before():
        for dims in dims_list:
            env = {**INT_FUNCS, **dims}
            for code in before:
                [int(eval(c, env)) for c in code]                                 # noqa: S307

    def run_after():
        for dims in dims_list:
            for code in after:
                [f(dims) for f in code]

    n = args.reps * len(dims_list) * len(grids)
    print(f"{len(grids)} grids x {len(STEPS)} step sizes: the same numbers")
    for name, fn in [("eval (before)", run_before), ("compile_int (after)", run_after)]:
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(args.reps):
                fn()
            best = min(best, time.perf_counter() - t0)
        print(f"  {name:20s} {best / n * 1e9:7.0f} ns per launch grid")


if __name__ == "__main__":
    main()
