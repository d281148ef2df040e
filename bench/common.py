"""What every benchmark records: the GPU, the commit, the date, and the copy bandwidth measured
in the same run (the floor of every latency is bytes over that bandwidth)."""
import datetime
import time
from pathlib import Path

import numpy as np

from infc.records import commit, results_dir, save    # noqa: F401 (the benchmarks import them from here)

RESULTS = results_dir()
# the hooks a spawned server may run (site_hooks/sitecustomize.py: GIL stalls, a request's marks)
SITE_HOOKS = Path(__file__).resolve().parent / "site_hooks"


def with_site_hooks(env: dict, var: str, out: str) -> dict:
    """env for a spawned server with site_hooks/ first on its PYTHONPATH and the hook that `var`
    (GIL_WATCH_OUT, SERVER_TRACE_OUT) turns on writing to `out`."""
    import os
    return {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(SITE_HOOKS), env.get("PYTHONPATH")])), var: out}


def copy_bandwidth(ctx, nbytes: int = 2 << 30, reps: int = 10) -> float:
    """Device-to-device copy, bytes read + written per second (median of reps)."""
    a, b = ctx.alloc(nbytes), ctx.alloc(nbytes)
    ctx.memset(a, nbytes, 1)
    times = []
    for _ in range(reps + 2):
        e0, e1 = ctx.event(), ctx.event()
        e0.record()
        ctx.dtod(b, a, nbytes)
        e1.record()
        times.append(e1.ms_since(e0))
    ctx.free(a)
    ctx.free(b)
    return 2 * nbytes / (float(np.median(times[2:])) * 1e-3)


def header(ctx, model: str) -> dict:
    """ctx: the CUDA context (its device name is recorded), or the name itself where there is none
    (the CPU backend, or a benchmark that only talks to a server)."""
    return {"gpu": ctx if isinstance(ctx, str) else ctx.name, "commit": commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "model": model}


PERCENTILES = (50, 90, 95, 99)


def latency_stats(xs, percentiles=PERCENTILES) -> dict:
    """Latencies in seconds -> mean, std and percentiles in ms (None and non-finite dropped)."""
    import math
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    if not xs:
        return {}
    a = np.asarray(xs) * 1e3
    d = {"mean_ms": float(a.mean()), "std_ms": float(a.std())}
    d.update({f"p{p}_ms": float(np.percentile(a, p)) for p in percentiles})
    return d


def figure(figsize=(7, 4)):
    """A matplotlib figure drawn off-screen (the GPU machines have no display)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt.subplots(figsize=figsize)


def finish(fig, ax, path: Path, title: str, res: dict):
    """Every plot names what it measured, on which GPU, at which commit and when."""
    ax.set_title(f"{title}\n({res['commit']}, {res['date']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)


class TimedCalls:
    """Seconds and calls spent inside some methods of one object (wrapped on the instance, so the
    class's own come back with restore): the engine thread's time in the KV tier's entry points."""

    def __init__(self, obj, names):
        self.obj, self.names = obj, tuple(names)
        self.seconds = 0.0
        self.calls = 0
        for name in self.names:
            setattr(obj, name, self._wrap(getattr(obj, name)))

    def _wrap(self, fn):
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.seconds += time.perf_counter() - t0
                self.calls += 1
        return timed

    def restore(self):
        for name in self.names:
            delattr(self.obj, name)
