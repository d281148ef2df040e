"""Run HERE before the call that checks a tuning run inside the model: the leave-one-out A/B.

`infc tune run` times each launch alone; an entry that wins alone can lose in the model (on the
H200, 2026-11-27, attention_decode's 128-key tiles: 7.18 -> 6.34 us alone, +0.15 ms a token in
qwen3-4b). So before a tuned table lands, each model it touches is timed with the committed table
("base"), with every new entry ("all") and with all but one ("loo<i>"), in alternating rounds:

    python tests/gpu/prepare_loo.py --new OUT/h200.json --model-dir .cache/gpu/configs/qwen3-30b-a3b \
        [--tune-results bench/results/tune-<model>-<gpu>-<commit>.json]  # only the keys it timed
    tests/gpu/carry.sh gpu/configs artifacts/<name>-loo-base artifacts/<name>-loo-all ...
    ARTS="<printed list>" CFG=.cache/gpu/configs/<name> PROFILE=0 bash tests/gpu/run.sh $OUT ab-latency

The new entries are the (template, key) pairs where --new differs from the committed table of its
GPU. The builds go over the committed table (--new is laid over it as build's tuning_overlay), both
GPUs' tables as tests/gpu/prepare.py builds them, into .cache/artifacts/<model dir name>-loo-*.
"""
import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "gpu"))
sys.path.insert(0, str(REPO / "tools"))


def new_entries(new: dict, old: dict, only: set | None = None) -> dict:
    """{template: {key: tune}} of `new`'s entries that `old` lacks or holds otherwise."""
    out = {}
    for tpl, entries in new.get("templates", {}).items():
        for key, tune in entries.items():
            if old.get("templates", {}).get(tpl, {}).get(key) != tune and (only is None or (tpl, key) in only):
                out.setdefault(tpl, {})[key] = tune
    return out


def without(overlay: dict, tpl: str, key: str) -> dict:
    out = {t: dict(e) for t, e in overlay.items()}
    del out[tpl][key]
    return {t: e for t, e in out.items() if e}


def main(argv=None):
    import prepare
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new", required=True, help="the table `infc tune run --write` wrote")
    ap.add_argument("--model-dir", required=True, help="config.json directory of the model to time")
    ap.add_argument("--tune-results", help="that run's results JSON: only the keys it timed for this model")
    a = ap.parse_args(argv)
    new = json.loads(Path(a.new).read_text())
    old = json.loads((REPO / "codegen_templates" / "tuning" / f"{new['gpu']}.json").read_text())
    only = None
    if a.tune_results:
        only = {(e["template"], e["shape_key"]) for e in json.loads(Path(a.tune_results).read_text())["entries"]}
    overlay = new_entries(new, old, only)
    if not overlay:
        raise SystemExit(f"{a.new}: no entry differs from the committed {new['gpu']} table")
    name = Path(a.model_dir).resolve().name
    art = REPO / ".cache" / "artifacts"
    names = [f"{name}-loo-base", f"{name}-loo-all"]
    prepare._both_tunings(f"{name}: committed table", art / names[0], model_dir=a.model_dir)
    prepare._both_tunings(f"{name}: every new entry", art / names[1], model_dir=a.model_dir,
                          tuning_overlay=overlay)
    pairs = [(t, k) for t, e in overlay.items() for k in e]
    for i, (t, k) in enumerate(pairs, 1):
        names.append(f"{name}-loo{i}")
        prepare._both_tunings(f"{names[-1]}: without {t} {k} {overlay[t][k]}", art / names[-1],
                              model_dir=a.model_dir, tuning_overlay=without(overlay, t, k))
    print("ARTS=\"" + " ".join(names) + "\"")


if __name__ == "__main__":
    main()
