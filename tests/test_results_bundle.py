"""tools/results_bundle.py: a run folder's JSON results packed into `<run>/results.jsonl.gz` index as
the files they were (source `<run>/results.jsonl.gz#<file>`), unpack to the same data, older plain
bundles are read and rewritten in the gzipped form, and bad input is refused with the file it is
about, before anything changes."""
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
import results_bundle  # noqa: E402
import results_index  # noqa: E402

LATENCY = {"gpu": "NVIDIA H200", "commit": "abc1234", "date": "2026-11-30 10:00 UTC", "model": "qwen3-4b",
           "tpot_ms_by_prompt": {"32": 2.0, "1024": 2.1}, "floor_ms_by_prompt": {"32": 1.5, "1024": 1.6}}
THROUGHPUT = {"gpu": "NVIDIA H100 80GB HBM3", "commit": "def5678", "model": "qwen3-4b", "input_len": 1024,
              "output_len": 128, "points": [{"concurrency": 64, "output_tok_s": 4700.5, "mean_tpot_ms": 9.9}]}
TUNE = {"gpu": "NVIDIA H200", "table": {"gemv": {"decode|Tx1": {"num_warps": 4}}}}


def _run(res: Path) -> Path:
    run = res / "some-run-h200-2026-11-30"
    for rel, data in (("1-call/tp1/latency-qwen3-4b.json", LATENCY), ("2-call/throughput.json", THROUGHPUT),
                      ("2-call/deeper/tune.json", TUNE)):
        (run / rel).parent.mkdir(parents=True, exist_ok=True)
        (run / rel).write_text(json.dumps(data, indent=2))
    (run / "README.md").write_text("# what was run\n")
    return run


def _unbundled(rows):
    return [{**r, "source": r["source"].replace(f"/{results_index.BUNDLE}#", "/")} for r in rows]


def test_pack_indexes_the_same_rows_and_unpack_restores_the_files(tmp_path):
    res = tmp_path / "results"
    run = _run(res)
    before, cov_before = results_index.build(res)
    assert results_bundle.pack(run) == 3
    assert sorted(p.relative_to(run).as_posix() for p in run.rglob("*")) == ["README.md", "results.jsonl.gz"]
    after, cov_after = results_index.build(res)
    assert _unbundled(after) == before and len(after) > 0
    assert {r["source"] for r in after} == {
        "some-run-h200-2026-11-30/results.jsonl.gz#1-call/tp1/latency-qwen3-4b.json",
        "some-run-h200-2026-11-30/results.jsonl.gz#2-call/throughput.json"}
    assert cov_after["unrecognised"] == ["some-run-h200-2026-11-30/results.jsonl.gz#2-call/deeper/tune.json"]
    assert (cov_after["files"], cov_after["indexed"]) == (cov_before["files"], cov_before["indexed"]) == (3, 2)
    assert results_bundle.unpack(run) == 3
    assert not (run / results_index.BUNDLE).exists()
    assert json.loads((run / "2-call/deeper/tune.json").read_text()) == TUNE
    assert results_index.build(res) == (before, cov_before)


def _plain(rows):
    return [{**r, "source": r["source"].replace(f"/{results_index.BUNDLE}#", f"/{results_index.PLAIN_BUNDLE}#")}
            for r in rows]


def test_an_older_plain_bundle_compacts_to_the_same_rows_in_fewer_bytes(tmp_path):
    """`compact`: a plain bundle (before 2026-12-06 #10; spaced separators before 2026-12-06) is read
    as it is, and rewritten gzipped and compact it indexes the same rows; packing writes that form."""
    res = tmp_path / "results"
    run = _run(res)
    results_bundle.pack(run)
    bundle = run / results_index.BUNDLE
    packed, rows = bundle.read_bytes(), results_index.build(res)
    text = results_index.bundle_text(bundle)
    spaced = "".join(json.dumps(json.loads(x), ensure_ascii=False) + "\n" for x in text.splitlines())
    bundle.unlink()
    (run / results_index.PLAIN_BUNDLE).write_text(spaced)
    plain_rows, plain_cov = results_index.build(res)
    assert plain_rows == _plain(rows[0]) and plain_cov["indexed"] == rows[1]["indexed"]
    assert results_bundle.compact(run) and bundle.read_bytes() == packed
    assert not (run / results_index.PLAIN_BUNDLE).exists()
    assert len(packed) < len(text.encode()) < len(spaced.encode()) and results_index.build(res) == rows
    assert not results_bundle.compact(run)


def test_pack_into_an_older_plain_bundle_writes_the_gzipped_one(tmp_path):
    run = _run(tmp_path / "results")
    results_bundle.pack(run)
    bundle = run / results_index.BUNDLE
    (run / results_index.PLAIN_BUNDLE).write_text(results_index.bundle_text(bundle))
    bundle.unlink()
    (run / "3-call").mkdir()
    (run / "3-call" / "latency.json").write_text(json.dumps(LATENCY))
    assert results_bundle.pack(run) == 1
    assert not (run / results_index.PLAIN_BUNDLE).exists()
    assert len([f for f, _ in results_index.bundle_entries(bundle)]) == 4


def test_pack_adds_to_a_bundle_and_refuses_a_result_it_holds(tmp_path):
    run = _run(tmp_path / "results")
    results_bundle.pack(run)
    (run / "0-call").mkdir()                                    # sorts before the packed ones
    (run / "0-call" / "latency.json").write_text(json.dumps(LATENCY))
    assert results_bundle.pack(run) == 1
    files = [f for f, _ in results_index.bundle_entries(run / results_index.BUNDLE)]
    assert files == sorted(files) and len(files) == 4
    (run / "2-call").mkdir()
    (run / "2-call" / "throughput.json").write_text(json.dumps(THROUGHPUT))
    with pytest.raises(results_bundle.PackError, match=r"2-call/throughput.json: already in"):
        results_bundle.pack(run)
    assert (run / "2-call" / "throughput.json").exists()


def test_a_file_that_is_not_json_packs_nothing(tmp_path):
    run = _run(tmp_path / "results")
    (run / "2-call" / "broken.json").write_text("{not json")
    with pytest.raises(results_bundle.PackError, match=r"2-call/broken.json: not JSON .*nothing packed"):
        results_bundle.pack(run)
    assert not (run / results_index.BUNDLE).exists() and len(list(run.rglob("*.json"))) == 4


def test_bad_bundles_are_named(tmp_path, capsys):
    res = tmp_path / "results"
    run = _run(res)
    results_bundle.pack(run)
    bundle = run / results_index.BUNDLE
    good = results_index.bundle_text(bundle)
    results_bundle.write_bundle(bundle, good + '{"file": "x.json"}\n')            # no "result"
    rows, cov = results_index.build(res)
    assert cov["unparsed"] == ["some-run-h200-2026-11-30/results.jsonl.gz"] and rows == []
    assert results_bundle.main(["unpack", str(run)]) == 2
    assert "results.jsonl.gz:4: not a" in capsys.readouterr().err
    results_bundle.write_bundle(bundle, good + json.dumps({"file": "../outside.json", "result": {}}) + "\n")
    with pytest.raises(results_bundle.PackError, match="not a path inside the run folder"):
        results_bundle.unpack(run)
    assert not (res / "outside.json").exists() and not (run / "2-call").exists()
    bundle.write_text(good)                                      # named .gz, not gzip
    rows, cov = results_index.build(res)
    assert cov["unparsed"] == ["some-run-h200-2026-11-30/results.jsonl.gz"] and rows == []
    assert results_bundle.main(["unpack", str(run)]) == 2
    assert "results.jsonl.gz: not gzip" in capsys.readouterr().err
    assert results_bundle.main(["unpack", str(tmp_path / "nowhere")]) == 2
    assert "no results.jsonl.gz to unpack" in capsys.readouterr().err
