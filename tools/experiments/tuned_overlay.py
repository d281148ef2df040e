"""The entries an `infc tune run` table changed, as a build overlay (tests/gpu/build_variants.py's
VARIANTS.json), so a tuner's winners can be built and timed in the model within one device call.

    python tools/experiments/tuned_overlay.py TUNED.json OUT.json [--label L] [--phases prefill,mixed]

TUNED.json: the table `infc tune run --write` wrote (the repository's table with the winners laid
over it); OUT.json: {L: {template: {shape key: tunables}}} holding each entry of TUNED.json that
differs from codegen_templates/tuning/<its gpu>.json, restricted to shape keys of --phases (the
part before the key's "|"). Prints the entries; exits 1 when there are none (nothing to build).
"""
import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def changed(tuned: dict, base: dict, phases) -> dict:
    """{template: {key: tunables}} of tuned's entries that base lacks or holds otherwise."""
    out = {}
    for template, entries in tuned.get("templates", {}).items():
        have = base.get("templates", {}).get(template, {})
        for key, tunables in entries.items():
            if phases and key.split("|", 1)[0] not in phases:
                continue
            if have.get(key) != tunables:
                out.setdefault(template, {})[key] = tunables
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(prog="tools/experiments/tuned_overlay.py")
    ap.add_argument("tuned")
    ap.add_argument("out")
    ap.add_argument("--label", default="tuned")
    ap.add_argument("--phases", default="", help="comma list of phases (default: every key)")
    a = ap.parse_args(argv)
    tuned = json.loads(Path(a.tuned).read_text())
    base = json.loads((REPO / "codegen_templates/tuning" / f"{tuned['gpu']}.json").read_text())
    overlay = changed(tuned, base, {p for p in a.phases.split(",") if p})
    for template, entries in overlay.items():
        for key, tunables in entries.items():
            print(f"{template} {key}: {tunables}")
    if not overlay:
        print("no entry changed")
        return 1
    Path(a.out).write_text(json.dumps({a.label: overlay}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
