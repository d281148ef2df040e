"""`infc bench startup`: process start -> ready, and the resident memory of an idle server.

Starts `infc serve` as users do (a fresh Python process) and times spawn -> the first 200 from
/health. The server says when it has attached its engine (its `serving` line); /health is polled
every millisecond from then, not before: every poll the loading server answers is Python it runs
beside its load (and under the GIL), so polling all along would slow what it measures. Then one
completion (one token), timed from the spawn too: ready means it answers one. The first start is
not recorded: it puts the weights in the page cache (and builds the artifact if needed), as a
restarted server finds them. The server's own stage timings are kept from its log, and each log
line's arrival time after the spawn (`timeline`: where the stages do not add up, the gaps show
where the time went). Idle RSS is VmRSS of the server process after it has been ready and idle
for a few seconds. The copy bandwidth is measured in the same run, afterwards.

Bytecode: where PYTHONDONTWRITEBYTECODE is set (the GPU sessions' machines set it, and their
wheels are installed with --no-compile), every start would compile infc, numpy, starlette and
uvicorn from source (~1.5 s of a 2 s budget). An installed server has its bytecode (pip compiles
it by default), so the starts measured here keep theirs under .cache/pycache, as the test suite
does (tests/conftest.py); the warm-up start writes it. The result records where it was kept.
"""
import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

STAGE = re.compile(r"^\s{2}(\S.*?)\s{2,}(\d+\.\d+) s$")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def server_env(gil_watch: str | None = None) -> dict:
    """The server's environment: this one, with bytecode kept (under .cache/pycache where none
    may be written beside the sources); gil_watch: a file for site_hooks/sitecustomize.py's GIL stalls."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if env.pop("PYTHONDONTWRITEBYTECODE", None) is not None:
        env.setdefault("PYTHONPYCACHEPREFIX", str(Path(__file__).resolve().parent.parent / ".cache" / "pycache"))
    if gil_watch:
        from .common import with_site_hooks
        env = with_site_hooks(env, "GIL_WATCH_OUT", gil_watch)
    return env


def first_completion(port: int) -> None:
    """One completion of one token from the model the server lists first."""
    base = f"http://127.0.0.1:{port}/v1"
    with urllib.request.urlopen(base + "/models", timeout=60) as r:
        model = json.load(r)["data"][0]["id"]
    body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 1}).encode()
    req = urllib.request.Request(base + "/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        if r.status != 200 or json.load(r)["usage"]["completion_tokens"] != 1:
            raise RuntimeError("infc serve reported ready but did not complete one token")


def start_once(model_path: str, extra: list[str], idle_s: float, timeout_s: float, gil_watch: bool = False) -> dict:
    """gil_watch: also the server's GIL stalls over 20 ms, as (start, seconds) after the spawn."""
    port = free_port()
    cmd = [sys.executable, "-m", "infc.cli", "serve", "--model-path", model_path, "--port", str(port), *extra]
    stalls = tempfile.NamedTemporaryFile("r", suffix=".gil") if gil_watch else None
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=server_env(stalls and stalls.name))
    timeline: list[tuple[float, str]] = []       # (seconds after the spawn, the line)

    def read():
        for line in p.stdout:
            timeline.append((round(time.perf_counter() - t0, 4), line.rstrip("\n")))
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        while not (any(line.startswith("serving ") for _, line in timeline) and healthy(port)):
            if p.poll() is not None:
                reader.join(5)
                tail = "\n".join(line for _, line in timeline)[-3000:]
                raise RuntimeError(f"infc serve exited with {p.returncode}:\n{tail}")
            if time.perf_counter() - t0 > timeout_s:
                raise RuntimeError(f"infc serve not ready after {timeout_s} s")
            time.sleep(0.001)
        ready = time.perf_counter() - t0
        first_completion(port)
        completed = time.perf_counter() - t0
        time.sleep(idle_s)
        rss = rss_mb(p.pid)
    finally:
        p.terminate()
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        reader.join(10)
    stages = [(m.group(1), float(m.group(2))) for m in (STAGE.match(line) for _, line in timeline) if m]
    out = {"ready_s": ready, "first_completion_s": completed, "idle_rss_mb": rss, "stages": stages,
           "timeline": timeline}
    if stalls is not None:
        with stalls:
            rows = (line.split() for line in stalls.read().splitlines())
            out["gil_stalls"] = [(round(float(at) - t0, 4), float(s)) for at, s in rows]
    return out


def plot(res: dict, path: Path):
    from .common import figure, finish
    run = res["runs"][res["median_run"]]
    names = [n for n, _ in run["stages"]] + ["(the rest: HTTP up, polling)"]
    secs = [s for _, s in run["stages"]]
    # a "(beside)" stage ran on its own thread, overlapping the others: not in the serial sum
    secs.append(max(run["ready_s"] - sum(s for n, s in run["stages"] if not n.endswith("(beside)")), 0.0))
    fig, ax = figure((7, 3.5))
    ax.barh(names[::-1], secs[::-1])
    ax.set_xlabel("seconds")
    finish(fig, ax, path, f"{res['model']} on {res['gpu']}: ready in {res['ready_s']:.2f} s, idle RSS "
           f"{res['idle_rss_mb']:.0f} MB", res)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="infc bench startup")
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--idle-s", type=float, default=3.0)
    ap.add_argument("--timeout-s", type=float, default=300.0)
    ap.add_argument("--out")
    ap.add_argument("--gil-watch", action="store_true", help="record the server's GIL stalls over 20 ms "
                    "(bench/site_hooks/sitecustomize.py on its PYTHONPATH)")
    from infc.server.args import add_load_format_arg
    add_load_format_arg(ap)       # dummy: ready time without the read (the fill is on the device)
    ap.add_argument("serve_args", nargs="*", help="extra `infc serve` flags (after --)")
    a = ap.parse_args(argv)
    extra = ["--device", "cuda", "--load-format", a.load_format, *a.serve_args]
    warm = start_once(a.model_path, extra, 0.5, a.timeout_s)          # page cache, artifact: not recorded
    print(f"warm-up start: {warm['ready_s']:.2f} s")
    runs = []
    for i in range(a.reps):
        r = start_once(a.model_path, extra, a.idle_s, a.timeout_s, a.gil_watch)
        runs.append(r)
        print(f"start {i + 1}: ready in {r['ready_s']:.2f} s (one token at {r['first_completion_s']:.2f}), "
              f"idle RSS {r['idle_rss_mb']:.0f} MB; "
              + ", ".join(f"{n} {s:.2f}" for n, s in r["stages"]), flush=True)
        if a.gil_watch:
            print("  GIL stalls (at, seconds): " + ", ".join(f"{t:.2f} {d:.2f}" for t, d in r["gil_stalls"]), flush=True)
    from infc.runtime.cuda.driver import Context
    from .common import copy_bandwidth, header, save
    ctx = Context()
    order = np.argsort([r["ready_s"] for r in runs])
    res = header(ctx, Path(a.model_path).name)
    res.update({"copy_GBps": copy_bandwidth(ctx) / 1e9, "serve_args": extra, "runs": runs,
                "median_run": int(order[len(order) // 2]),
                "ready_s": float(np.median([r["ready_s"] for r in runs])),
                "first_completion_s": float(np.median([r["first_completion_s"] for r in runs])),
                "idle_rss_mb": float(np.median([r["idle_rss_mb"] for r in runs])),
                "warmup_ready_s": warm["ready_s"],
                "bytecode": server_env().get("PYTHONPYCACHEPREFIX", "beside the sources")})
    path = save("startup", res, a.out)
    plot(res, path.with_suffix(".png"))
    print(f"ready in {res['ready_s']:.2f} s (median of {a.reps}), idle RSS {res['idle_rss_mb']:.0f} MB; wrote {path}")
    return res


if __name__ == "__main__":
    main()
