"""Benchmark results as data: bench/index.csv is what tools/results_index.py builds from the JSON
under bench/results/, and the generated tables in README.md and docs/benchmarks.md are what
tools/results_table.py renders from the index (a stale one fails here: regenerate it)."""
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
import results_index  # noqa: E402
import results_table  # noqa: E402


def test_index_is_fresh():
    rows, cov = results_index.build()
    assert results_index.INDEX.read_text() == results_index.to_csv(rows), \
        "bench/index.csv is stale: run python tools/results_index.py"
    assert cov["unparsed"] == [], f"unreadable JSON results: {cov['unparsed']}"
    # most results that name a GPU are benchmark results: a parser that stopped recognising one
    # kind shows here (the rest: tuning tables, timelines; experiments' own JSON may name none)
    assert cov["indexed"] >= 0.9 * cov["with_gpu"], cov


def test_every_source_is_a_result_in_the_tree():
    """`source` names a JSON file under bench/results/, or an entry of a run's bundle."""
    bundles = {}
    for r in results_index.read():
        path, _, entry = r["source"].partition("#")
        assert (results_index.RESULTS / path).is_file(), f"{r['source']}: no such file under bench/results/"
        if entry:
            if path not in bundles:
                bundles[path] = {f for f, _ in results_index.bundle_entries(results_index.RESULTS / path)}
            assert entry in bundles[path], f"{r['source']}: {path} has no entry {entry!r}"


def test_results_stay_small_on_disk():
    """bench/results/ on a checkout stays under 5 MiB as `du` counts it (each file and folder at least
    a 4 KB block): a session's many small JSON files go into its run's bundle."""
    block = 4096
    used = sum(-(-max(f.stat().st_size, 1) // block) * block if f.is_file() else block
               for f in results_index.RESULTS.rglob("*")) + block
    assert used <= 5 * 2**20, (
        f"bench/results/ takes {used / 2**20:.1f} MiB on disk: pack the new runs "
        "(python tools/results_bundle.py pack bench/results/RUN) or leave their logs out")


def test_generated_tables_are_fresh():
    table = results_table.current_table()
    for target in results_table.TARGETS:
        text = target.read_text()
        assert results_table.splice(text, table, target) == text, \
            f"{target.relative_to(REPO)}: the results table is stale: run python tools/results_table.py"


def test_a_stale_table_is_caught():
    """The freshness check compares with a fresh render: a hand-edited figure differs."""
    readme = (REPO / "README.md").read_text()
    head, rest = readme.split(results_table.BEGIN, 1)
    body, tail = rest.split(results_table.END, 1)
    i = next(i for i, c in enumerate(body) if c.isdigit())
    edited = head + results_table.BEGIN + body[:i] + str((int(body[i]) + 1) % 10) + body[i + 1:] \
        + results_table.END + tail
    assert results_table.splice(edited, results_table.current_table(), REPO / "README.md") != edited


def _write(d: Path, name: str, data) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_text(json.dumps(data))
    return d / name


def test_parsers_by_content_not_name(tmp_path):
    """A result is read by its fields whatever its file is called; every figure becomes a row with
    the run's date, commit and GPU; the floor ratios are floor / time; peers get their own rows."""
    res = tmp_path / "results"
    _write(res / "some-run-2026-11-30" / "a", "whatever.json", {
        "gpu": "NVIDIA H200", "commit": "abc1234 (+ a note)", "date": "2026-11-30 10:00 UTC",
        "model": "qwen3-4b", "load_format": "dummy",
        "tpot_ms_by_prompt": {"32": 2.0}, "ttft_ms": {"32": 4.0}, "floor_ms_by_prompt": {"32": 1.5},
        "hf_tpot_ms_by_prompt": {"32": 6.0}, "torch_compile_tpot_ms_by_prompt": {"32": 3.0}})
    _write(res, "throughput-x.json", {
        "gpu": "NVIDIA H100 80GB HBM3", "commit": "def5678", "date": "2026-11-29 09:00 UTC",
        "model": "qwen3-4b", "input_len": 1024, "output_len": 128, "max_num_batched_tokens": 8192,
        "points": [{"concurrency": 256, "output_tok_s": 6000.0, "mean_tpot_ms": 30.0}]})
    _write(res, "tune-table.json", {"gpu": "NVIDIA H200", "table": {}})
    (res / "broken.json").write_text("{not json")
    rows, cov = results_index.build(res)
    by = {(r["benchmark"], r["metric"], r["settings"]): r for r in rows}
    lat = by[("latency", "tpot_ms", "prompt=32;load=dummy")]
    assert (lat["gpu"], lat["commit"], lat["date"]) == ("H200", "abc1234", "2026-11-30 10:00")
    assert lat["source"] == "some-run-2026-11-30/a/whatever.json"
    assert float(by[("latency", "floor_ratio", "prompt=32;load=dummy")]["value"]) == 0.75
    assert float(by[("latency", "torch_compile_floor_ratio", "prompt=32;load=dummy")]["value"]) == 0.5
    assert float(by[("latency", "hf_tpot_ms", "prompt=32;load=dummy")]["value"]) == 6.0
    tp = by[("throughput", "output_tok_s", "concurrency=256;input=1024;out=128;budget=8192")]
    assert (tp["gpu"], float(tp["value"])) == ("H100", 6000.0)
    assert cov == {"files": 4, "with_gpu": 3, "indexed": 2, "unparsed": ["broken.json"],
                   "unrecognised": ["tune-table.json"]}


def test_a_current_row_the_index_lacks_is_an_error(tmp_path):
    index = [{"gpu": "H200", "model": "m", "benchmark": "latency", "settings": "prompt=32",
              "metric": "tpot_ms", "value": "2.0", "source": "run-a/x.json", "date": "2026-11-30",
              "commit": "abc"}]
    spec = {"what": "decode", "gpu": "H200", "model": "m", "benchmark": "latency",
            "settings": "prompt=32", "metric": "tpot_ms", "run": "run-a/"}
    assert "| 2.000 ms |" in results_table.render(index, [spec])
    with pytest.raises(results_table.TableError, match="no row of bench/index.csv"):
        results_table.render(index, [dict(spec, run="run-b/")])
    with pytest.raises(results_table.TableError, match="no floor_ratio"):
        results_table.render(index, [dict(spec, ratio="floor_ratio")])
