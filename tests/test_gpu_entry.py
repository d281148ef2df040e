"""tests/gpu/run.sh, the one entry point of a GPU run: it knows every stage session.sh runs, refuses
an unknown one before anything starts, groups consecutive session stages into one session, and
docs/benchmarks.md names every stage. (Runs no stage: nothing here needs a GPU.)"""
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUN = REPO / "tests" / "gpu" / "run.sh"


def run(*args):
    return subprocess.run(["bash", str(RUN), *args], capture_output=True, text=True, timeout=30, cwd=REPO)


def stages() -> tuple[list[str], list[str]]:
    out = run("--list").stdout
    session = re.search(r"session stages: (.*)", out).group(1).split()
    runs = re.search(r"run stages: (.*)", out).group(1).split()
    return session, runs


def test_it_knows_every_session_stage():
    text = (REPO / "tests" / "gpu" / "session.sh").read_text()
    body = text[text.index("for stage in $STAGES"):]
    labels = {lab for case in re.findall(r"^    ([a-z0-9|-]+)\)", body, re.M) for lab in case.split("|")}
    session, _ = stages()
    assert labels and labels == set(session)


def test_each_run_stage_has_its_function():
    text = RUN.read_text()
    _, runs = stages()
    assert runs and all(f"run_{s.replace('-', '_')}() (" in text for s in runs)
    assert not list((REPO / "tests" / "gpu").glob("call_*.sh")), "the per-call wrappers are folded into run.sh"


def test_unknown_or_missing_stage_is_refused():
    r = run("--dry-run", "/tmp/out", "latency", "latncy")
    assert r.returncode == 2 and "unknown stage 'latncy'" in r.stderr
    r = run("/tmp/out")
    assert r.returncode == 2 and "no stage given" in r.stderr


def test_consecutive_session_stages_run_as_one_session():
    r = run("--dry-run", "/tmp/out", "suite", "latency", "ab-latency", "serve")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["session [suite latency] -> /tmp/out/suite",
                                     "run ab-latency -> /tmp/out/ab-latency",
                                     "session [serve] -> /tmp/out/serve"]
    assert run("--dry-run", "/tmp/out", "latency", "throughput").stdout.strip() == \
        "session [latency throughput] -> /tmp/out"


def test_the_docs_name_every_stage():
    doc = (REPO / "docs" / "benchmarks.md").read_text()
    session, runs = stages()
    missing = [s for s in session + runs if f"`{s}`" not in doc]
    assert missing == [], f"docs/benchmarks.md does not name these stages: {missing}"
