"""Run on the GPU machine: where a CUDA-Graph decode step's time goes, launch by launch.

    python tests/gpu/timeline.py --artifact A --model-path CFG [--context 32] [--reps 20] --out DIR

`bench profile` times each launch of an eager step between events, which takes away what PDL
overlaps (every kernel's prologue, its first weight loads) and adds an event's cost to each one.
Serving replays graphs, where a kernel starts while the one before it drains. This tool records
the replays with CUPTI (through torch.profiler: a measurement here, never at run time) and gives,
for each launch position of the step, its median start, duration and exposed time: the end of this
kernel less the end of the one before it, which is what the launch adds to the step. The replays
are spread out by host sleeps, so the trace splits into steps at its idle gaps.
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def steps_of(kernels: list[dict], gap_us: float = 200.0) -> list[list[dict]]:
    """Kernels sorted by start, split wherever the GPU sat idle for more than gap_us."""
    out, end = [], None
    for k in sorted(kernels, key=lambda k: k["ts"]):
        if end is None or k["ts"] - end > gap_us:
            out.append([])
        out[-1].append(k)
        end = k["ts"] + k["dur"] if end is None else max(end, k["ts"] + k["dur"])
    return out


def positions(steps: list[list[dict]], names: list[str]) -> list[dict]:
    """Per launch position: median start (from the step's first kernel), duration, exposed time."""
    # done[s][i]: when the step's launches before position i had all ended (its first start at 0)
    done = []
    for s in steps:
        before, last = [], s[0]["ts"]
        for k in s:
            before.append(last)
            last = max(last, k["ts"] + k["dur"])
        done.append(before)
    rows = []
    for i, name in enumerate(names):
        start = [s[i]["ts"] - s[0]["ts"] for s in steps]
        dur = [s[i]["dur"] for s in steps]
        exposed = [s[i]["ts"] + s[i]["dur"] - d[i] for s, d in zip(steps, done)]
        rows.append({"index": i, "kernel": name, "start_us": statistics.median(start),
                     "dur_us": statistics.median(dur), "exposed_us": statistics.median(exposed)})
    return rows


def by_kernel(rows: list[dict]) -> list[dict]:
    groups: dict[str, dict] = {}
    for r in rows:
        g = groups.setdefault(r["kernel"], {"kernel": r["kernel"], "runs": 0, "dur_us": 0.0, "exposed_us": 0.0})
        g["runs"] += 1
        g["dur_us"] += r["dur_us"]
        g["exposed_us"] += r["exposed_us"]
    return sorted(groups.values(), key=lambda g: -g["exposed_us"])


def main(argv=None):
    ap = argparse.ArgumentParser(prog="tests/gpu/timeline.py")
    ap.add_argument("--artifact", required=True)
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--context", type=int, default=32, help="prompt tokens before the decode step")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    import numpy as np
    import torch  # noqa: F401  (CUPTI through kineto; the runner itself does not use it)
    from torch.profiler import ProfilerActivity, profile
    from infc.bench.profile import PageTable, Profiler, launch_sites
    from infc.runtime.cuda.runner import CudaRunner
    from infc.compiler.contract.program import program_name
    from infc.runtime.engine.step import Chunk

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    # the profiler is on before the runner captures its graphs: CUPTI then sees every graph node
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        r = CudaRunner(a.artifact, a.model_path, max_num_batched_tokens=max(a.context, 64), max_num_seqs=4,
                       buckets=[1], num_pages=64 + a.context // 8, load_format="dummy")
        try:
            pages = PageTable(r.num_pages, r.page_size)
            pages.ensure(0, a.context + 1)
            p = Profiler(r, 1, 0, None)
            p._once([Chunk(0, [int(t) for t in rng.integers(0, r.vocab_size, a.context)], 0)], pages, "eager")
            dec = [Chunk(0, [int(rng.integers(0, r.vocab_size))], a.context)]
            for _ in range(3):
                p._once(dec, pages, "graph")
            walls = []
            for _ in range(a.reps):
                time.sleep(0.003)
                walls.append(p._once(dec, pages, "graph")["gpu"])
            phase = program_name(r.plan, "decode", 1)
            sites = [s for s, e in zip(launch_sites(r.plan, phase), r.program(phase)) if e[0] is not None]
        finally:
            r.close()
    trace = out / "trace.json"
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    steps = steps_of(kernels)
    # the last reps steps are the replays; each starts with the program's launches (the sampler's
    # kernels may follow them)
    n = len(sites)
    replays = [s[:n] for s in steps if len(s) >= n][-a.reps:]
    names = [f"{site['key']} {site['op']}" for site in sites]
    if len(replays) < a.reps // 2 or any(len({s[i]["name"] for s in replays}) != 1 for i in range(n)):
        raise SystemExit(f"timeline: fewer than {a.reps // 2} {n}-launch replays of one program "
                         f"(step sizes {[len(s) for s in steps[-2 * a.reps:]]})")
    rows = positions(replays, names)
    for row, k in zip(rows, replays[0]):
        row["cuda_name"] = k["name"]
    span = statistics.median(s[-1]["ts"] + s[-1]["dur"] - s[0]["ts"] for s in replays)
    res = {"artifact": a.artifact, "context": a.context, "phase": phase, "replays": len(replays),
           "launches": n, "span_us": span, "event_gpu_ms": statistics.median(walls),
           "positions": rows, "by_kernel": by_kernel(rows)}
    (out / "timeline.json").write_text(json.dumps(res, indent=1))
    trace.unlink()
    print(f"{a.artifact}: {len(replays)} replays of the {phase} program's {n} launches; "
          f"span {span:.1f} us; events {res['event_gpu_ms'] * 1e3:.1f} us")
    print("| kernel | runs | dur us (sum) | exposed us (sum) |\n| --- | --- | --- | --- |")
    for g in res["by_kernel"][:16]:
        print(f"| {g['kernel'][:60]} | {g['runs']} | {g['dur_us']:.1f} | {g['exposed_us']:.1f} |")
    print("first layer, by position:")
    for row in rows[:12]:
        print(f"  {row['index']:3d} {row['kernel'][:50]:50s} start {row['start_us']:8.2f} "
              f"dur {row['dur_us']:6.2f} exposed {row['exposed_us']:6.2f}")


if __name__ == "__main__":
    main()
