"""The parent side of an experiment that runs its combinations in child processes, so a crash, a
hang or a lost CUDA context costs one combination and not the run (the concluded gemm_ws.py,
skinny_gemm.py and mid_gemm.py used it: `git show 1d31c02:bench/experiments/NAME.py`).

The protocol: the child, `python3 SCRIPT OUT --child NAME a:b,c:d,...`, runs the combinations
(a, b) it is given in order; before each it writes "a b" to PART.current, and after each it
rewrites PART (a JSON list of rows) with the row added. The parent reruns a fresh child on what is
left after a crash; the combination the dead child was on, if it left no row, gets failed_row's
row with the reason and the tail of the children's stderr (PART.log), and is not run again.
"""
import json
import os
import subprocess
import sys
from pathlib import Path


def run(script: Path, out: Path, part: Path, name: str, todo: list, key, failed_row, timeout: float,
        stop_after_timeout: bool = False) -> list:
    """Rows for the combinations todo [(int, str)] of `name`; key(row) -> its (int, str);
    failed_row(combination, why) -> the row of one that killed its child. stop_after_timeout: a
    child killed for time ends the run (what is left would likely hang too)."""
    log, current = part.with_suffix(".log"), part.with_suffix(".current")
    part.parent.mkdir(parents=True, exist_ok=True)
    for f in (part, log, current):
        f.unlink(missing_ok=True)
    todo = list(todo)
    for _ in range(len(todo) + 1):
        why = None
        current.unlink(missing_ok=True)
        try:
            with open(log, "a") as err:
                p = subprocess.run([sys.executable, str(script), str(out), "--child", name,
                                    ",".join(f"{a}:{b}" for a, b in todo)], stderr=err, timeout=timeout)
            why = f"child exited with {p.returncode}" if p.returncode else None
        except subprocess.TimeoutExpired:
            why = f"child killed after {timeout} s"
        rows = json.loads(part.read_text()) if part.exists() else []
        have = {key(r) for r in rows}
        todo = [c for c in todo if c not in have]
        if not todo or not why:
            break
        cur = current.read_text().split() if current.exists() else None
        cur = (int(cur[0]), cur[1]) if cur else None
        if cur in todo:
            tail = " ".join(log.read_text()[-400:].split()) if log.exists() else ""
            rows.append(failed_row(cur, f"{why}; stderr tail: {tail}"))
            part.write_text(json.dumps(rows, indent=1))
            print(f"  {name} {cur[0]} {cur[1]} CRASH ({why})", flush=True)
            todo.remove(cur)
        if not todo or (stop_after_timeout and why.startswith("child killed")):
            break
    return json.loads(part.read_text()) if part.exists() else []


def keep(row: dict, rows: list, part: Path):
    """Child side: the finished combination's row added, PART rewritten (the parent reads it)."""
    rows.append(row)
    part.write_text(json.dumps(rows, indent=1))


def failure(e: Exception, row: dict, rows: list, part: Path, sync=None):
    """Child side, in the except of a combination: its compile or run failure recorded in its row,
    not raised. If the CUDA context is lost as well (a sticky error: sync raises), the row is
    written and the child exits, for the parent to start a fresh one on the rest."""
    row["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[-600:]}"
    if sync is None:
        import torch
        sync = torch.cuda.synchronize
    try:
        sync()
    except Exception as e2:
        row["error"] += f" | context lost: {str(e2)[:200]}"
        part.write_text(json.dumps(rows + [row], indent=1))
        os._exit(3)


def child_entry(args: list, run_child, parts_dir: str):
    """The child's command line, `OUT --child NAME a:b,c:d,...`: run_child(NAME, [(a, "b"), ...],
    OUT/parts_dir/NAME.json). An exception is printed and the child exits 2 (the parent starts a
    fresh one on what is left)."""
    import traceback
    i = args.index("--child")
    todo = [(int(c.split(":")[0]), c.split(":", 1)[1]) for c in args[i + 2].split(",")]
    try:
        run_child(args[i + 1], todo, Path(args[0]) / parts_dir / f"{args[i + 1]}.json")
    except Exception:
        traceback.print_exc()
        sys.exit(2)


def run_linear_rows(script: Path, out: Path, parts_dir: str, lin: str, todo: list, timeout: float) -> list:
    """Parent side of the linear experiments (skinny_gemm.py, mid_gemm.py): rows {"linear", "M",
    "variant", ...} for the (M, variant) combinations todo of one linear, in child processes (a
    fresh child after a crash; a child killed for time ends the linear); a combination that got
    no row gets one saying so."""
    def failed(c, why):
        return {"linear": lin, "M": c[0], "variant": c[1], "us": None, "error": why}
    rows = run(script, out, out / parts_dir / f"{lin}.json", lin, todo, lambda r: (r["M"], r["variant"]),
               failed, timeout, stop_after_timeout=True)
    have = {(r["M"], r["variant"]) for r in rows}
    return rows + [failed(c, "not run (child failures or timeout)") for c in todo if c not in have]


def cli(args: list, main, run_child, parts_dir: str, default_out: str, check=None, compile_only=None):
    """An experiment's command line: `OUT` (the GPU run), `--child ...` (child_entry), and where
    the script has them `--check` (the interpreter, on the CPU) and `--compile-only` (AOT here);
    the two exit 0 when they passed."""
    if compile_only is not None and "--compile-only" in args:
        sys.exit(0 if compile_only() else 1)
    elif check is not None and "--check" in args:
        sys.exit(0 if check() else 1)
    elif "--child" in args:
        child_entry(args, run_child, parts_dir)
    else:
        main(Path(args[0] if args and not args[0].startswith("--") else default_out))
