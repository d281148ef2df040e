"""Run HERE (no GPU): build one model's artifact once per tuning overlay, for an in-model A/B
(tests/gpu/run.sh ab-latency) of kernel tiles that `infc tune` cannot judge alone (PDL overlap,
preloads: bench/NOTES.md).

    python tests/gpu/build_variants.py VARIANTS.json MODEL_DIR NAME [--gpu h200] [--page-size N] [--narrow-tokens R]
        -> .cache/artifacts/NAME-<label> for each label of VARIANTS.json, and NAME-base (no overlay)

VARIANTS.json: {"label": {template: {shape key: {tunable: value}}}, ...} (build.load_tuning's
overlay form; a "narrow|..." key reaches the narrow program alone). A label's "_config" entry
sets infc/config.py constants for its build alone, e.g. {"_config": {"UPCAST_EXPERTS": true}}: the
MXFP4 experts upcast in many-token steps (compiler/passes/upcast_experts.py, off by default).
Prints the ARTS line for run.sh ab-latency. Commit first: the artifacts name no commit of their own.
"""
import argparse
import contextlib
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def config_overrides(config: dict):
    """infc/config.py's constants set to config's values while a build runs (a variant's
    "_config"; prepare.py records it in built_from.json for rerender.py)."""
    import infc.config
    unknown = sorted(k for k in config if not hasattr(infc.config, k))
    if unknown:
        raise ValueError(f"no infc/config.py constant named {', '.join(unknown)}")
    saved = {k: getattr(infc.config, k) for k in config}
    try:
        for k, v in config.items():
            setattr(infc.config, k, v)
        yield
    finally:
        for k, v in saved.items():
            setattr(infc.config, k, v)


def unmatched(plan: dict, overlay: dict) -> list[str]:
    """The overlay's "template / key" entries that no launch of the plan renders with (a "default"
    entry reaches every launch of its template)."""
    from infc.compiler.codegen.render import tuning_keys
    from infc.compiler.contract.program import launches
    used = {(ln["kernel"], key) for phase, program in plan["programs"].items()
            for ln, _ in launches(program) for key in tuning_keys(plan, ln, phase) + ("default",)}
    return [f"{t} / {k}" for t, entries in overlay.items() for k in entries if (t, k) not in used]


def main(argv=None):
    ap = argparse.ArgumentParser(prog="tests/gpu/build_variants.py")
    ap.add_argument("variants")
    ap.add_argument("model_dir")
    ap.add_argument("name")
    ap.add_argument("--gpu", default="h200", choices=["h100", "h200"])
    ap.add_argument("--page-size", type=int, help="KV cache page size of every variant (default: the build's for --gpu)")
    ap.add_argument("--narrow-tokens", type=int,
                    help="a speculative build's verify rows (k + 1; its verify program's keys are verify|S|r<N>)")
    a = ap.parse_args(argv)
    from infc.compiler.build import build
    variants = json.loads(Path(a.variants).read_text())
    if not isinstance(variants, dict) or not all(isinstance(v, dict) for v in variants.values()):
        sys.exit(f"{a.variants}: want {{label: overlay}}")
    names = []
    for label, overlay in {"base": {}, **variants}.items():
        overlay = dict(overlay)
        out = REPO / ".cache/artifacts" / f"{a.name}-{label}"
        try:
            with config_overrides(overlay.pop("_config", {})):
                build(out=str(out), gpu=a.gpu, log=None, model_dir=a.model_dir, tuning_overlay=overlay or None,
                      page_size=a.page_size, narrow_tokens=a.narrow_tokens)
        except ValueError as e:
            sys.exit(f"{a.variants}: {label}: {e}")
        stray = unmatched(json.loads((out / "plan.json").read_text()), overlay)
        if stray:        # an A/B whose variant is its base: the keys name launches the plan no longer has
            sys.exit(f"{a.variants}: {label}: no launch of the plan renders with " + ", ".join(stray)
                     + " (its keys: infc inspect, or compiler/codegen/render.py tuning_keys)")
        names.append(out.name)
        print(f"built {out.name}", flush=True)
    print('ARTS="' + " ".join(names) + '"')


if __name__ == "__main__":
    main()
