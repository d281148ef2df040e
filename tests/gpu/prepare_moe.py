"""Run HERE before a GPU session that times qwen3-30b-a3b (issue 11): config.json of the published
model (its spec variant's values) for the full 48 layers and a 4-layer cut at the same shapes,
each with its artifact (cubins), for `--load-format dummy` runs (the weights are made on the GPU).

    python tests/gpu/prepare_moe.py   # -> .cache/gpu/configs/qwen3-30b-a3b{,-l4}/ + .cache/gpu/<name>-art
On the GPU: STAGES=moe tests/gpu/session.sh OUT (bench latency and bench profile on both).
"""
import json
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
GPU_CACHE = REPO / ".cache" / "gpu"
CUTS = {"qwen3-30b-a3b": None, "qwen3-30b-a3b-l4": 4}


def config() -> dict:
    spec = yaml.safe_load((REPO / "specs" / "qwen3_moe.yaml").read_text())
    cfg = dict(spec["variants"]["qwen3-30b-a3b"])
    cfg.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe")
    return cfg


def write_config(name: str) -> Path:
    """.cache/gpu/configs/<name>/config.json for a cut of CUTS."""
    cfg, layers = config(), CUTS[name]
    if layers:
        cfg.update(num_hidden_layers=layers, max_window_layers=layers)
    d = GPU_CACHE / "configs" / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    return d


def main():
    for name in CUTS:
        d = write_config(name)
        from infc.cli import main as cli          # in-process: the infc this script imports
        if cli(["build", "--model-path", str(d), "--out", str(GPU_CACHE / f"{name}-art")]) != 0:
            raise SystemExit(f"building {name} failed")
        print(f"[prepare_moe] {name}: {d}/config.json, artifact {GPU_CACHE / (name + '-art')}")


if __name__ == "__main__":
    main()
