"""Run on the GPU machine: re-render carried artifacts for this GPU's tuning table.

    python tests/gpu/rerender.py .cache/artifacts/qwen3-4b-tp2 ...

prepare.py builds each artifact for the H100 table, then the H200 one, into one directory: bin/
holds both tables' cubins and the plan is the H200 table's. A benchmark or test that loads an
artifact directly (not through load_backend, which renders for the GPU it finds) would run the
H200 plan on an H100: this re-renders the plan for this GPU, from the config recorded in
built_from.json (prepare.py writes it beside every artifact it builds for both tables),
compiling nothing (every cubin is already there).
"""
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def rerender(art: Path, gpu: str | None = None, patched: bool = False) -> str:
    """Re-render `art` for `gpu` (default: this machine's table) if its plan is another table's.
    An artifact tools/experiments/lora_site_probe.py built from a patched template is re-rendered
    by that tool (patched=True), never here: the tree's template would give other kernels."""
    from infc.backend import gpu_tuning
    if (art / "lora_site_probe").exists() and not patched:
        return f"{art.name}: built by tools/experiments/lora_site_probe.py: re-render it with that tool"
    from infc.compiler.build import build
    plan = art / "plan.json" if (art / "plan.json").exists() else art / "plan.rank0.json"
    if not plan.exists():
        return f"{art}: no plan (not carried?)"
    gpu = gpu or gpu_tuning()
    built = json.loads(plan.read_text())["build"]["gpu"]
    if built == gpu:
        return f"{art.name}: {gpu} plan already"
    how = json.loads((art / "built_from.json").read_text())     # prepare.py's _both_tunings
    sys.path.insert(0, str(REPO / "tests" / "gpu"))
    from build_variants import config_overrides
    with config_overrides(how.pop("config", {})):
        build(out=art, gpu=gpu, log=None, **{**how, "model_dir": str(REPO / how["model_dir"])})
    return f"{art.name}: re-rendered {built} -> {gpu}"


if __name__ == "__main__":
    for a in sys.argv[1:]:
        print(f"[rerender] {rerender(Path(a))}", flush=True)
