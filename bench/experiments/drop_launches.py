"""What would a fusion that removes some launches save? An upper bound, measured before building it.

Copies an artifact and deletes, from the layer bodies of one program (decode by default), every
launch whose op is named. The copy computes garbage (the dropped launches' outputs are whatever
the arena held), so it is for timing only: `bench latency --no-hf` against the original gives
the most those launches can cost in the step (their own time, their boundaries and what they
hold back), which a fusion removing them cannot beat.

    python bench/experiments/drop_launches.py ART OUT_ART concat,add [--program decode] [--kinds moe]

Run here (no GPU): the copy shares the original's cubins, so it compiles nothing.
"""
import argparse
import json
import shutil
from pathlib import Path


def drop(plan: dict, ops: set, program: str = "decode", kinds: set | None = None) -> int:
    """Delete the launches of `ops` from `program`'s layer bodies (only `kinds` if given): how many."""
    dropped = 0
    for item in plan["programs"][program]:
        for kind, body in item.get("kinds", {}).items():
            if kinds and kind not in kinds:
                continue
            keep = [l for l in body if l.get("op") not in ops]
            dropped += (len(body) - len(keep)) * item["schedule"].count(kind)
            body[:] = keep
    return dropped


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("art")
    ap.add_argument("out")
    ap.add_argument("ops", help="comma-separated ops (the plan's 'op' names: concat, add, rope, ...)")
    ap.add_argument("--program", default="decode")
    ap.add_argument("--kinds", help="comma-separated layer kinds (default: all)")
    a = ap.parse_args(argv)
    src, out = Path(a.art), Path(a.out)
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(src, out)
    plan = json.loads((out / "plan.json").read_text())
    n = drop(plan, set(a.ops.split(",")), a.program, set(a.kinds.split(",")) if a.kinds else None)
    if n == 0:
        raise SystemExit(f"{src}: no launch of {a.ops} in program '{a.program}'")
    plan["build"]["dropped_for_timing"] = {"ops": a.ops, "program": a.program, "launches_a_step": n}
    (out / "plan.json").write_text(json.dumps(plan, indent=1))
    (out / "built_from.json").unlink(missing_ok=True)     # never re-rendered: it would restore them
    print(f"{out}: {n} launches a step dropped ({a.ops})")


if __name__ == "__main__":
    main()
