"""Where an engine-level warm prefix hit's time goes (issue 10). `bench prefix` times add_request
through the step that samples; `bench profile --steps prefix_hit` times the step's GPU work alone,
and on an H200 the two differ by ~2 ms at a 1k prefix and ~10 ms at 16k. This times the same
warm hit as bench prefix (same engine, same submit loop) with each host stage wrapped:
add_request, the scheduler, the block manager, build_step, the runner's upload / launch / wait,
the sampler; then one cProfile of a warm hit, by own time.

    python3 bench/experiments/prefix_breakdown.py --model-path DIR [--lengths 1024,16384] OUT
"""
import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np



class Timers:
    """Wraps methods in place; each call's wall time is added to its name for the current rep."""

    def __init__(self):
        self.now = defaultdict(float)
        self.calls = defaultdict(int)

    def wrap(self, obj, name: str, label: str):
        f = getattr(obj, name)

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                self.now[label] += time.perf_counter() - t
                self.calls[label] += 1
        setattr(obj, name, timed)

    def take(self) -> dict:
        out = {k: v * 1e3 for k, v in self.now.items()}
        self.now.clear()
        return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--lengths", default="1024,16384")
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--load-format", default="auto")
    a = ap.parse_args(argv)
    from infc.backend import load_backend
    from infc.runtime.engine import step as step_mod
    from infc.runtime.engine import engine as engine_mod
    from infc.runtime.engine.sampling import SamplingParams

    b = load_backend(a.model_path, device=a.device, asynchronous=False, enable_prefix_caching=True,
                     load_format=a.load_format)
    engine, runner = b.engine, b.engine.runner
    T = Timers()
    T.wrap(engine, "add_request", "add_request")
    T.wrap(engine, "_launch", "engine._launch")
    T.wrap(engine, "_collect", "engine._collect")
    T.wrap(engine, "_chunks", "engine._chunks")
    sched = engine.scheduler if hasattr(engine, "scheduler") else None
    if sched is not None:
        T.wrap(sched, "schedule", "scheduler.schedule")
    for name in ("admit", "grow", "commit", "release", "cached_blocks"):
        if hasattr(engine.bm, name):
            T.wrap(engine.bm, name, f"bm.{name}")
    for name in ("_upload", "_metadata", "_run_step", "launch", "collect", "execute"):
        if hasattr(runner, name):
            T.wrap(runner, name, f"runner.{name}")
    if getattr(runner, "sampler", None) is not None:
        for name in ("start", "finish", "sample"):
            if hasattr(runner.sampler, name):
                T.wrap(runner.sampler, name, f"sampler.{name}")
    orig_build = engine_mod.build_step if hasattr(engine_mod, "build_step") else None
    if orig_build is not None:
        T.wrap(engine_mod, "build_step", "build_step")
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    rng = np.random.default_rng(0)
    count = iter(range(1 << 62))
    steps_in = []

    def submit(prompt):
        rid = f"bd-{next(count)}"
        t0 = time.perf_counter()
        engine.add_request(prompt, params, rid)
        got, n = None, 0
        while got is None:
            n += 1
            for o in engine.step():
                if o.request_id == rid:
                    got = (time.perf_counter() - t0, o.num_cached_tokens)
        steps_in.append(n)
        while engine.has_unfinished():
            engine.step()
        return got

    V = b.vocab_size
    make = lambda n: [int(x) for x in rng.integers(100, V - 100, n)]  # noqa: E731
    submit(make(32))
    T.take()
    res = {"device": getattr(getattr(runner, "ctx", None), "name", a.device), "lengths": {}}
    for L in [int(x) for x in a.lengths.split(",")]:
        prefix = make(L)
        submit(prefix + make(a.new))                     # fills the cache (cold, untimed)
        submit(prefix + make(a.new))                     # the first warm one, untimed
        T.take()
        reps = []
        for _ in range(a.reps):
            steps_in.clear()
            ttft, cached = submit(prefix + make(a.new))
            reps.append({"ttft_ms": ttft * 1e3, "cached": cached, "steps": steps_in[0], **T.take()})
        keys = sorted({k for r in reps for k in r if k not in ("cached",)})
        med = {k: float(np.median([r.get(k, 0.0) for r in reps])) for k in keys}
        res["lengths"][str(L)] = {"median": med, "reps": reps}
        print(f"== L={L}: warm +{a.new}, medians of {a.reps} (cached {reps[0]['cached']})")
        for k in sorted(med, key=lambda k: -med[k]):
            print(f"  {k:24s} {med[k]:9.3f}")
        # one more, under cProfile (slower by its hooks; read the shares)
        pr = cProfile.Profile()
        pr.enable()
        submit(prefix + make(a.new))
        pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
        res["lengths"][str(L)]["cprofile"] = s.getvalue()
        print(s.getvalue()[:6000])
        T.take()
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "prefix_breakdown.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
