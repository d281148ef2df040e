"""bench/index.csv: every figure the benchmarks measured, one row each, built from the JSON results
under bench/results/.

    python tools/results_index.py            # rewrite bench/index.csv, print coverage
    python tools/results_index.py --check    # exit 1 if bench/index.csv is stale

A row: date, commit, gpu, model, benchmark, settings, metric, value, source. `settings` is
`key=value` pairs joined by `;` (a prompt length, a concurrency, a step budget, ranks...), so one
(gpu, model, benchmark, settings, metric) names one measured quantity across runs and `source`
(the JSON file, or a bundle's entry, relative to bench/results/) says which run measured it.

The results come in three naming schemes (`<bench>-<model>-<gpu>-<commit>.json` at the top, run
folders `<what>-<gpu>-<commit>-<date>/` with per-call subfolders, and experiments' own files), and
the benchmarks' JSON grew fields over time, so each file is read by what it holds, not by its name:
a parser per benchmark recognises its keys. Files no parser recognises (tuning tables, kernel
timelines, one-off experiments) are counted, not indexed.

A run folder's results may be packed into one file, `<run>/results.jsonl.gz` (tools/results_bundle.py:
one line per result file, `{"file": its path in the run folder, "result": its JSON}`, gzipped); each
entry is read as the file it was, its source `<run>/results.jsonl.gz#<file>`. A plain
`<run>/results.jsonl` (bundles before 2026-12-06 #10) is read the same way.
"""
import argparse
import csv
import gzip
import io
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
INDEX = REPO / "bench" / "index.csv"
COLUMNS = ["date", "commit", "gpu", "model", "benchmark", "settings", "metric", "value", "source"]
DATE_IN_PATH = re.compile(r"(20\d\d-\d\d-\d\d)")
BUNDLE = "results.jsonl.gz"
PLAIN_BUNDLE = "results.jsonl"     # the ungzipped form, still read


class BundleError(ValueError):
    """A line of a results bundle that is not one {"file", "result"} entry."""


def bundle_text(path: Path) -> str:
    """A bundle's lines, gunzipped where it is gzipped (a .gz that is not gzip raises BundleError)."""
    if path.name.endswith(".gz"):
        try:
            return gzip.decompress(path.read_bytes()).decode()
        except (OSError, EOFError) as err:
            raise BundleError(f"{path}: not gzip ({err})") from None
    return path.read_text()


def bundle_entries(path: Path):
    """(file, result) of each line of a bundle; a bad line raises BundleError naming it."""
    for n, line in enumerate(bundle_text(path).splitlines(), 1):
        try:
            e = json.loads(line)
        except ValueError as err:
            raise BundleError(f"{path}:{n}: not JSON ({err})") from None
        if not (isinstance(e, dict) and isinstance(e.get("file"), str) and "result" in e):
            raise BundleError(f"{path}:{n}: not a {{\"file\": ..., \"result\": ...}} entry")
        yield e["file"], e["result"]


UNREADABLE = object()


def results_of(results: Path):
    """(source, parsed JSON or UNREADABLE) of every result under `results`: each JSON file, and
    each entry of each run's bundle (a bundle with a bad line counts as one unreadable source)."""
    for f in sorted(results.rglob("*.json")):
        try:
            d = json.loads(f.read_text())
        except (ValueError, UnicodeDecodeError):
            d = UNREADABLE
        yield f.relative_to(results).as_posix(), d
    for b in sorted([*results.rglob(BUNDLE), *results.rglob(PLAIN_BUNDLE)]):
        rel = b.relative_to(results).as_posix()
        try:
            entries = list(bundle_entries(b))
        except (BundleError, UnicodeDecodeError):
            yield rel, UNREADABLE
            continue
        for file, d in entries:
            yield f"{rel}#{file}", d


def gpu_name(raw) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'H100', 'NVIDIA H200' -> 'H200'; anything else as given."""
    m = re.search(r"\b([A-Z]\d{2,3}[A-Za-z]?)\b", str(raw or ""))
    return m.group(1) if m else str(raw or "")


def settings_of(**kw) -> str:
    return ";".join(f"{k}={v}" for k, v in kw.items() if v not in (None, "", False))


def ranks(d: dict) -> dict:
    """A parallel run's ranks as settings (nothing for one GPU)."""
    out = {}
    for key, name in (("tensor_parallel_size", "tp"), ("expert_parallel_size", "ep"),
                      ("data_parallel_size", "dp")):
        if (d.get(key) or 1) > 1:
            out[name] = d[key]
    return out


def per_prompt(d: dict, key: str) -> dict:
    """{prompt length: value} of a field recorded per prompt (a dict; {} otherwise)."""
    v = d.get(key)
    if isinstance(v, dict):
        return {k: x for k, x in v.items() if isinstance(x, (int, float))}
    return {}


# --- one parser per benchmark: (metric, settings, value) triples of one result ---------------

def latency(d: dict):
    """`infc bench latency`: per prompt length, infc's TPOT / TTFT, the floor, its ratio, and the
    peers timed in the same run (HF static cache + compile, the torch.compile decode loop)."""
    base = dict(load=d.get("load_format"), out=d.get("output_len"), **ranks(d))
    series = {"tpot_ms": "tpot_ms_by_prompt", "ttft_ms": "ttft_ms", "floor_ms": "floor_ms_by_prompt",
              "hf_tpot_ms": "hf_tpot_ms_by_prompt", "hf_ttft_ms": "hf_ttft_ms",
              "torch_compile_tpot_ms": "torch_compile_tpot_ms_by_prompt",
              "torch_compile_ttft_ms": "torch_compile_ttft_ms",
              "active_floor_ms": "active_floor_ms_by_prompt"}
    by = {m: per_prompt(d, k) for m, k in series.items()}
    if not by["tpot_ms"] and isinstance(d.get("tpot_ms"), (int, float)):
        by["tpot_ms"] = {"first": d["tpot_ms"]}           # the earliest results: one prompt
        if isinstance(d.get("floor_ms"), (int, float)):
            by["floor_ms"] = {"first": d["floor_ms"]}
    for metric, vals in by.items():
        for p, v in vals.items():
            yield metric, settings_of(prompt=p, **base), v
    for p, t in by["tpot_ms"].items():      # each time against the floor: floor / time
        for floor, name in (("floor_ms", "floor_ratio"), ("active_floor_ms", "active_floor_ratio")):
            if p in by[floor] and t:
                yield name, settings_of(prompt=p, **base), by[floor][p] / t
        for peer in ("hf", "torch_compile"):
            if p in by[f"{peer}_tpot_ms"] and p in by["floor_ms"]:
                yield f"{peer}_floor_ratio", settings_of(prompt=p, **base), \
                    by["floor_ms"][p] / by[f"{peer}_tpot_ms"][p]


def throughput(d: dict):
    """`infc bench throughput`: per concurrency, output tok/s, mean TPOT, TTFT."""
    base = dict(input=d.get("input_len"), out=d.get("output_len"), load=d.get("load_format"),
                budget=d.get("max_num_batched_tokens"), **ranks(d))
    for p in d.get("points") or []:
        if not isinstance(p, dict) or "concurrency" not in p:
            continue
        s = settings_of(concurrency=p["concurrency"], **base)
        for m in ("output_tok_s", "mean_tpot_ms", "median_ttft_ms", "p99_ttft_ms"):
            if isinstance(p.get(m), (int, float)):
                yield m, s, p[m]


def structured(d: dict):
    """`infc bench structured`: per concurrency, TPOT with and without a JSON schema on every
    request and their ratio; a new schema's compile and first-token times."""
    base = dict(input=d.get("input_len"), out=d.get("output_len"))
    for p in d.get("points") or []:
        if isinstance(p, dict) and "concurrency" in p:
            s = settings_of(concurrency=p["concurrency"], **base)
            for m in ("tpot_ms_plain", "tpot_ms_schema", "tpot_ratio"):
                if isinstance(p.get(m), (int, float)):
                    yield m, s, p[m]
    for m, v in (d.get("first_token") or {}).items():
        if m != "schemas" and isinstance(v, (int, float)):
            yield m, settings_of(input=d.get("input_len")), v


def prefix(d: dict):
    """`infc bench prefix`: per path (engine, serve) and cached length, cold and warm TTFT."""
    for path, r in (d.get("paths") or {}).items():
        for length, cell in (r.get("results") or {}).items() if isinstance(r, dict) else ():
            for phase in ("cold", "warm"):
                stats = cell.get(phase) if isinstance(cell, dict) else None
                if not isinstance(stats, dict):
                    continue
                s = settings_of(path=path, cached=length, new=(d.get("settings") or {}).get("new_tokens"))
                for q in ("p50_ms", "p99_ms"):
                    if isinstance(stats.get(q), (int, float)):
                        yield f"{phase}_ttft_{q}", s, stats[q]


def startup(d: dict):
    """`infc bench startup`: spawn -> /health 200, and idle RSS (the median run's)."""
    run = d.get("median_run") if isinstance(d.get("median_run"), dict) else d
    for m in ("ready_s", "idle_rss_mb"):
        if isinstance(run.get(m), (int, float)):
            yield m, "", run[m]


def serve(d: dict):
    """`infc bench serve`: per request rate, output throughput and TTFT / TPOT p50 over HTTP."""
    for r in d.get("results") or []:
        s = settings_of(rate=r.get("request_rate"), input=d.get("input_len"), out=d.get("output_len"))
        if isinstance(r.get("output_throughput"), (int, float)):
            yield "output_tok_s", s, r["output_throughput"]
        for k in ("ttft", "tpot"):
            if isinstance(r.get(k), dict) and isinstance(r[k].get("p50_ms"), (int, float)):
                yield f"{k}_p50_ms", s, r[k]["p50_ms"]


def allreduce(d: dict):
    """`infc bench allreduce`: one all-reduce's time per row count, NCCL and peer_sum."""
    for r in d.get("rows") or []:
        if isinstance(r, dict):
            for m in ("nccl_us", "peer_sum_us"):
                if isinstance(r.get(m), (int, float)):
                    yield m, settings_of(rows=r.get("rows"), world=d.get("world")), r[m]


def profile(d: dict):
    """`infc bench profile`: each profiled step's GPU time (the launches stay in the JSON)."""
    for st in d.get("steps") or []:
        if isinstance(st, dict) and isinstance(st.get("gpu_ms"), (int, float)):
            yield "step_gpu_ms", settings_of(step=st.get("name"), page_size=d.get("page_size")), st["gpu_ms"]


def parser_for(d) -> tuple[str, object] | tuple[None, None]:
    """(benchmark name, parser) by the keys a result holds."""
    if not isinstance(d, dict) or "gpu" not in d:
        return None, None
    if "tpot_ms_by_prompt" in d or ("tpot_ms" in d and "floor_ms" in d):
        return "latency", latency
    if isinstance(d.get("points"), list) and "first_token" in d:
        return "structured", structured
    if isinstance(d.get("points"), list):
        return "throughput", throughput
    if isinstance(d.get("paths"), dict):
        return "prefix", prefix
    if "ready_s" in d or "median_run" in d:
        return "startup", startup
    if isinstance(d.get("results"), list) and "base_url" in d:
        return "serve", serve
    if "nccl_us" in json.dumps(d.get("rows", ""))[:2000]:
        return "allreduce", allreduce
    if isinstance(d.get("steps"), list) and "page_size" in d:
        return "profile", profile
    return None, None


def run_date(d: dict, rel: str) -> str:
    """The result's own date ('2026-11-28 07:49'), else the date in its run folder's name."""
    raw = str(d.get("date") or "")
    m = re.match(r"(\d{4}-\d\d-\d\d)(?:[ T](\d\d:\d\d))?", raw)
    if m:
        return " ".join(x for x in m.groups() if x)
    m = DATE_IN_PATH.search(rel)
    return m.group(1) if m else ""


def build(results: Path = RESULTS):
    """(rows sorted, coverage {"files", "with_gpu" (results that name a GPU: every benchmark's; an
    experiment's own JSON, such as a probe's, may not), "indexed", "unparsed": [rel...],
    "unrecognised": [rel...]})."""
    rows, cov = [], {"files": 0, "with_gpu": 0, "indexed": 0, "unparsed": [], "unrecognised": []}
    for rel, d in results_of(results):
        cov["files"] += 1
        if d is UNREADABLE:
            cov["unparsed"].append(rel)
            continue
        cov["with_gpu"] += isinstance(d, dict) and "gpu" in d
        bench, parse = parser_for(d)
        if parse is None:
            cov["unrecognised"].append(rel)
            continue
        commit = re.match(r"[0-9a-f]*", str(d.get("commit") or "")).group(0)   # drop any note after it
        model = Path(str(d.get("model") or "")).name          # `bench serve` records the model's path
        head = dict(date=run_date(d, rel), commit=commit, gpu=gpu_name(d.get("gpu")), model=model,
                    benchmark=bench, source=rel)
        n = 0
        for metric, s, value in parse(d):
            rows.append({**head, "settings": s, "metric": metric, "value": f"{float(value):.6g}"})
            n += 1
        cov["indexed"] += n > 0
        if n == 0:
            cov["unrecognised"].append(rel)
    rows.sort(key=lambda r: [r[c] for c in COLUMNS])
    return rows, cov


def to_csv(rows) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, COLUMNS, lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    return buf.getvalue()


def read(index: Path = INDEX) -> list[dict]:
    with open(index, newline="") as f:
        return list(csv.DictReader(f))


def main(argv=None):
    ap = argparse.ArgumentParser(prog="results_index.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if bench/index.csv is stale")
    a = ap.parse_args(argv)
    rows, cov = build()
    text = to_csv(rows)
    if a.check:
        fresh = INDEX.exists() and INDEX.read_text() == text
        print("bench/index.csv is " + ("fresh" if fresh else "stale: run python tools/results_index.py"))
        return 0 if fresh else 1
    INDEX.write_text(text)
    by_bench = {}
    for r in rows:
        by_bench[r["benchmark"]] = by_bench.get(r["benchmark"], 0) + 1
    print(f"{INDEX.relative_to(REPO)}: {len(rows)} rows from {cov['indexed']} of {cov['files']} JSON "
          f"results ({', '.join(f'{k} {v}' for k, v in sorted(by_bench.items()))}); "
          f"{len(cov['unrecognised'])} not benchmark results (tuning tables, timelines, experiments), "
          f"{len(cov['unparsed'])} unreadable")
    return 0


if __name__ == "__main__":
    sys.exit(main())
