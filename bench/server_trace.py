"""Where a request's time goes inside `infc serve` (`bench prefix --trace-server`): the server runs
with site_hooks/sitecustomize.py on its PYTHONPATH, which writes a time for each mark a request passes;
`breakdown` lines those up with the client's own send and first-token times."""
import statistics
from pathlib import Path

# a request's marks, in the order it passes them (site_hooks/sitecustomize.py); "first" is the
# client's first token. BESIDE: marks off that path: the loop takes the request back from the
# worker pool ("pool<") while the engine already runs it (the pool queues it: server/app.py)
ORDER = ("conn", "asgi", "body", "pool>", "send", "add", "step>", "step<", "put", "chunk")
BESIDE = ("pool<",)


def server_env(env: dict, out: str) -> dict:
    """env with the trace on: the site hooks first on PYTHONPATH, marks into `out`."""
    from .common import with_site_hooks
    return with_site_hooks(env, "SERVER_TRACE_OUT", out)


def read_marks(path: str) -> list[tuple[float, str]]:
    marks = []
    for line in Path(path).read_text().splitlines():
        t, name = line.split(" ", 1)
        marks.append((float(t), name))
    return sorted(marks)


def breakdown(marks: list[tuple[float, str]], spans: list[tuple[float, float]]) -> dict:
    """Per mark, the median ms after the client's send of the first time each request (a span:
    the client's send and first-token times) passed it within its span; a mark met in fewer than
    half the spans is left out. Also "first": the client's first token."""
    at: dict[str, list[float]] = {}
    for t0, t1 in spans:
        seen = set()
        for t, name in marks:
            if t0 <= t <= t1 and name not in seen:
                seen.add(name)
                at.setdefault(name, []).append((t - t0) * 1e3)
        at.setdefault("first", []).append((t1 - t0) * 1e3)
    keep = [n for n in ORDER + ("first",) + BESIDE if len(at.get(n, ())) * 2 >= len(spans)]
    return {n: round(statistics.median(at[n]), 3) for n in keep}


def describe(b: dict) -> str:
    """One line: each mark's median ms after the send, in order (then those beside the path)."""
    path = ", ".join(f"{n} {v:.2f}" for n, v in b.items() if n not in BESIDE)
    beside = ", ".join(f"{n} {v:.2f}" for n, v in b.items() if n in BESIDE)
    return path + (f" (beside: {beside})" if beside else "")
