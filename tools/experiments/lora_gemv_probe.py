"""Issue 46: qwen3-4b's four LoRA-site GEMVs of the narrow (batch-1) program, each timed alone on
the GPU over a grid of the shrink's schedule (LORA_KS, LORA_PROGRAMS, LORA_EARLY) beside the base
build's GEMV of the same shape. The kernels are the build's own (codegen_templates/triton/gemv.py.j2
rendered by `infc tune prepare` for the plan's launches), the timing `infc tune run`'s (a CUDA
graph of launches over rotating weight copies, weights from HBM): nothing here is a copy of either.

    # build machine (no GPU; ~10 min on two cores, cached after):
    .venv/bin/python tools/experiments/lora_gemv_probe.py prepare
    # -> .cache/tune/qwen3-4b-narrow-h200 (the base GEMVs, their baseline kernels only)
    #    .cache/tune/qwen3-4b-lora8r16-narrow-h200 (the LoRA sites, the narrow LoRA grid)
    # GPU machine, one call (tests/gpu/session.sh stage lora-tune runs both, then the report):
    STAGES=lora-tune tests/gpu/session.sh OUT     # or: bash tests/gpu/run.sh OUT lora-tune
    # anywhere, on that call's results:
    .venv/bin/python tools/experiments/lora_gemv_probe.py report OUT

The report: per launch the base GEMV's us, the LoRA site's at this tree's defaults, at the schedule
measured +22 % on 2026-12-03 (LORA_KS 128, LORA_PROGRAMS 16), its best candidate, and the grid.
"""
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DIRS = {"base": "qwen3-4b-narrow-h200", "lora": "qwen3-4b-lora8r16-narrow-h200"}
NAMES = {"6144x2560": "q|k|v", "2560x4096": "o", "19456x2560": "gate|up", "2560x9728": "down"}
OLD = {"LORA_KS": 128, "LORA_PROGRAMS": 16}       # the a48345d run's schedule (its tail aside)
LAYERS = 36
BASE_STEP_MS = 2.341                              # base decode_b1 graph, H200, a48345d


def prepare(gpu="h200"):
    """Both manifests, compiled; the base one keeps each launch's baseline kernel only."""
    from infc.compiler.codegen.aot import compile_kernels
    from infc.compiler.codegen.render import Kernel
    from infc.compiler.tune import prepare as tune_prepare
    from infc.config import lora_build
    for what, name in DIRS.items():
        out = REPO / ".cache" / "tune" / name.replace("h200", gpu)
        tune_prepare("qwen3-4b", gpu, out=out, phases=("narrow",), templates=("gemv", "gemv_gated"),
                     compile=False, log=print, lora=lora_build(8, 16) if what == "lora" else None)
        m = json.loads((out / "manifest.json").read_text())
        kernels = {}
        for e in m["entries"]:
            if what == "base":
                e["candidates"] = e["candidates"][:1]
            for c in e["candidates"]:
                kernels[c["kernel"]] = Kernel(c["kernel"], e["backend"], e["template"],
                                              (out / c["source"]).read_text(), c["meta"])
        compile_kernels(kernels, out / "bin", m["target"])
        m["compiled"] = True
        (out / "manifest.json").write_text(json.dumps(m, indent=1) + "\n")
        print(f"{out}: {len(m['entries'])} launches, {len(kernels)} kernels compiled")


def _results(folder: Path) -> dict:
    """shape key -> the tune run's entry record, from the results file(s) in folder."""
    out = {}
    for f in sorted(folder.glob("tune-*.json")):
        for e in json.loads(f.read_text())["entries"]:
            out[e["shape_key"]] = e
    return out


def _name(key: str) -> str:
    return next((n for s, n in NAMES.items() if s in key), key)


def _us(entry: dict, tune: dict):
    for c in entry["candidates"]:
        if c["tune"] == tune and c["ok"]:
            return c["us"]
    return None


def report(out: Path):
    base, lora = _results(out / DIRS["base"]), _results(out / DIRS["lora"])
    f = lambda v: f"{v:7.2f}" if v is not None else "      -"      # noqa: E731
    print(f"{'launch':8s} {'base':>7s} {'lora':>7s} {'old':>7s} {'best':>7s}  best tune")
    step = 0.0
    for key, e in sorted(lora.items(), key=lambda kv: _name(kv[0])):
        b = base.get(key.rsplit("|lora", 1)[0], {}).get("default_us")
        d = e["default_us"]
        if b is not None and d is not None:
            step += (d - b) * LAYERS
        print(f"{_name(key):8s} {f(b)} {f(d)} {f(_us(e, OLD))} {f(e.get('best_us'))}  {e.get('best_tune')}")
    print(f"\nat the defaults, the four sites add {step / 1e3:.3f} ms to a step "
          f"({LAYERS} layers): ~{BASE_STEP_MS + step / 1e3:.3f} ms against the base's {BASE_STEP_MS}")
    for key, e in sorted(lora.items(), key=lambda kv: _name(kv[0])):
        print(f"\n{_name(key)} ({key}): us by LORA_KS x LORA_PROGRAMS (def: the template default)")
        grid = {}
        for c in e["candidates"]:
            t = c["tune"]
            if set(t) <= {"LORA_KS", "LORA_PROGRAMS"} and c["ok"]:
                grid[(t.get("LORA_KS", "def"), t.get("LORA_PROGRAMS", "def"))] = c["us"]
        cols = sorted({p for _, p in grid}, key=str)
        print("   KS " + " ".join(f"{str(p):>7s}" for p in cols))
        for ks in sorted({k for k, _ in grid}, key=str):
            print(f"{str(ks):>5s} " + " ".join(f(grid.get((ks, p))) for p in cols))
        others = [(c["tune"], c["us"]) for c in e["candidates"]
                  if c["ok"] and not set(c["tune"]) <= {"LORA_KS", "LORA_PROGRAMS"}]
        for t, us in others:
            print(f"      {f(us)}  {t}")


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "prepare":
        prepare(*sys.argv[2:3])
    elif len(sys.argv) == 3 and sys.argv[1] == "report":
        report(Path(sys.argv[2]))
    else:
        raise SystemExit(__doc__)
