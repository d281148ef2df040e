"""tools/experiments/child_runs.py: an experiment's combinations in child processes. A child that
dies on a combination costs that one (a row with the reason and the stderr tail), a fresh child
runs the rest; a child that hangs is killed at the timeout, and with stop_after_timeout the run
ends there."""
import importlib.util
import json
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("child_runs", REPO / "tools" / "experiments" / "child_runs.py")
child_runs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(child_runs)

CHILD = textwrap.dedent('''
    import json, os, sys, time
    from pathlib import Path
    out, name, todo = Path(sys.argv[1]), sys.argv[3], sys.argv[4]
    part = out / "parts" / f"{name}.json"
    rows = json.loads(part.read_text()) if part.exists() else []
    for c in todo.split(","):
        a, b = c.split(":")
        (part.with_suffix(".current")).write_text(f"{a} {b}")
        if b == "crash":
            print("boom in", a, file=sys.stderr, flush=True)
            os._exit(3)
        if b == "hang":
            time.sleep(60)
        rows.append({"a": int(a), "b": b, "v": int(a) * 10})
        part.write_text(json.dumps(rows))
''')


def _run(tmp_path, todo, **kw):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    failed = lambda c, why: {"a": c[0], "b": c[1], "v": None, "why": why}  # noqa: E731
    return child_runs.run(script, tmp_path, tmp_path / "parts" / "x.json", "x", todo,
                          lambda r: (r["a"], r["b"]), failed, **kw)


def test_a_crash_costs_one_combination(tmp_path):
    rows = _run(tmp_path, [(1, "ok"), (2, "crash"), (3, "ok"), (4, "crash"), (5, "ok")], timeout=30)
    by = {(r["a"], r["b"]): r for r in rows}
    assert [by[(a, "ok")]["v"] for a in (1, 3, 5)] == [10, 30, 50]
    for a in (2, 4):
        r = by[(a, "crash")]
        assert r["v"] is None and "exited with 3" in r["why"] and f"boom in {a}" in r["why"]
    assert len(rows) == 5


def test_a_hang_is_killed_and_can_end_the_run(tmp_path):
    todo = [(1, "ok"), (2, "hang"), (3, "ok")]
    rows = _run(tmp_path, todo, timeout=3)
    by = {(r["a"], r["b"]): r for r in rows}
    assert "killed after 3 s" in by[(2, "hang")]["why"] and by[(3, "ok")]["v"] == 30
    rows = _run(tmp_path, todo, timeout=3, stop_after_timeout=True)
    assert {(r["a"], r["b"]) for r in rows} == {(1, "ok"), (2, "hang")}
    assert json.loads((tmp_path / "parts" / "x.json").read_text()) == rows


def test_child_side_failure_and_keep(tmp_path):
    """failure() records a combination's error in its row; keep() adds the row and rewrites PART;
    where the context is lost too (sync raises), the row is written and the child exits 3."""
    import subprocess
    import sys
    part = tmp_path / "p.json"
    rows, row = [], {"a": 1, "error": None}
    child_runs.failure(ValueError("no  such\n kernel"), row, rows, part, sync=lambda: None)
    assert row["error"] == "ValueError: no such kernel" and not part.exists()
    child_runs.keep(row, rows, part)
    assert json.loads(part.read_text()) == [row]
    code = textwrap.dedent(f'''
        import importlib.util, sys
        from pathlib import Path
        spec = importlib.util.spec_from_file_location("c", {str(REPO / "tools" / "experiments" / "child_runs.py")!r})
        c = importlib.util.module_from_spec(spec); spec.loader.exec_module(c)
        def lost():
            raise RuntimeError("illegal address")
        c.failure(KeyError("x"), {{"a": 2, "error": None}}, [{{"a": 1}}], Path({str(part)!r}), sync=lost)
        print("not reached")
    ''')
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 3 and "not reached" not in p.stdout
    got = json.loads(part.read_text())
    assert got[0] == {"a": 1} and got[1]["a"] == 2 and "context lost: illegal address" in got[1]["error"]
