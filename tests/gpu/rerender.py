"""Run on the GPU machine: re-render carried artifacts for this GPU's tuning table.

    python tests/gpu/rerender.py .cache/artifacts/qwen3-4b-tp2 ...

prepare.py builds each artifact for the H100 table, then the H200 one, into one directory: bin/
holds both tables' cubins and the plan is the H200 table's. A benchmark or test that loads an
artifact directly (not through load_backend, which renders for the GPU it finds) would run the
H200 plan on an H100: this re-renders the plan for this GPU, from the config recorded in
built_from.json, compiling nothing (every cubin is already there).
"""
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def rerender(art: Path) -> str:
    from infc.backend import gpu_tuning
    from infc.compiler.build import build
    plan = art / "plan.json" if (art / "plan.json").exists() else art / "plan.rank0.json"
    gpu = gpu_tuning()
    built = json.loads(plan.read_text())["build"]["gpu"]
    if built == gpu:
        return f"{art.name}: {gpu} plan already"
    how = json.loads((art / "built_from.json").read_text())
    build(model_dir=str(REPO / how["config"]), out=art, gpu=gpu, log=None,
          tensor_parallel_size=how["tensor_parallel_size"], enable_expert_parallel=how["enable_expert_parallel"])
    return f"{art.name}: re-rendered {built} -> {gpu}"


if __name__ == "__main__":
    for a in sys.argv[1:]:
        print(f"[rerender] {rerender(Path(a))}", flush=True)
