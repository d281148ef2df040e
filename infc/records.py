"""Where a measurement is written, and which commit made it: the benchmarks (bench/) and the
kernel tuner (`infc tune run`, runtime/cuda/tune_run.py) record their results alike. Numpy-free
and torch-free, so the runtime can write a record without importing the benchmarks."""
import importlib.util
import json
import os
import subprocess
from pathlib import Path
from infc import envs


def results_dir() -> Path:
    """bench/results, wherever the infc.bench package lives (a source tree or an install)."""
    return Path(importlib.util.find_spec("infc.bench").submodule_search_locations[0]) / "results"


def commit() -> str:
    if envs.value("INFC_COMMIT"):          # the GPU machine gets a tree without .git
        return envs.value("INFC_COMMIT")
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def save(name: str, data: dict, out: Path | None = None) -> Path:
    out = Path(out or results_dir())
    out.mkdir(parents=True, exist_ok=True)
    gpu = data.get("gpu", "gpu").replace(" ", "-").lower()
    path = out / f"{name}-{data['model']}-{gpu}.json"
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path
