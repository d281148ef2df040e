"""Plot one quantity of bench/index.csv over time (plots are drawn on demand, not committed).

    python tools/results_plot.py --gpu H200 --model qwen3-4b --benchmark latency \
        --metric tpot_ms --settings 'prompt=32;load=auto' --out /tmp/tpot.png

Every row matching the filters is a point at its date, one series per settings string, so A/B
variants and repeated rounds show as the spread they were.
"""
import argparse
import sys
from datetime import datetime

import results_index


def select(rows, gpu, model, benchmark, metric, settings=None):
    return [r for r in rows if (r["gpu"], r["model"], r["benchmark"], r["metric"]) == (gpu, model, benchmark, metric)
            and (settings is None or r["settings"] == settings)]


def main(argv=None):
    ap = argparse.ArgumentParser(prog="results_plot.py", description=__doc__.split("\n\n")[0])
    for k in ("gpu", "model", "benchmark", "metric"):
        ap.add_argument(f"--{k}", required=True)
    ap.add_argument("--settings", help="one settings string (default: every one, a series each)")
    ap.add_argument("--out", required=True, help="the PNG to write")
    a = ap.parse_args(argv)
    rows = select(results_index.read(), a.gpu, a.model, a.benchmark, a.metric, a.settings)
    if not rows:
        print(f"results_plot.py: no row of bench/index.csv has {a.metric} for {a.model} on {a.gpu} "
              f"({a.benchmark}{', ' + a.settings if a.settings else ''})", file=sys.stderr)
        return 2
    try:
        import matplotlib
    except ImportError:
        print("results_plot.py: needs matplotlib (pip install matplotlib)", file=sys.stderr)
        return 2
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4))
    for s in sorted({r["settings"] for r in rows}):
        pts = sorted((datetime.fromisoformat(r["date"]), float(r["value"])) for r in rows if r["settings"] == s)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o", label=s or "(no settings)", alpha=0.7)
    ax.set_ylabel(a.metric)
    ax.set_title(f"{a.model} on {a.gpu}: {a.benchmark} {a.metric}")
    ax.legend(fontsize=7)
    fig.autofmt_xdate()
    fig.savefig(a.out, dpi=120, bbox_inches="tight")
    print(f"wrote {a.out} ({len(rows)} points)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
