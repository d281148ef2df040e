"""A PEFT LoRA adapter directory with random weights for a model directory (the fixtures of
issue 46: adapters to serve without a hub or a training run).

    python tools/make_lora_adapter.py --model DIR --out DIR [--rank 16] [--alpha 32] [--rslora]
        [--targets q_proj v_proj ...] [--rank-pattern down_proj=8 ...] [--alpha-pattern ...]
        [--seed 0] [--dtype f32|bf16]

It writes what PEFT's save_pretrained writes: adapter_config.json (peft_type LORA, r, lora_alpha,
use_rslora, target_modules, rank_pattern, alpha_pattern) and adapter_model.safetensors with
base_model.model.<module>.lora_A.weight [r, K] and .lora_B.weight [N, r] for every 2-D linear of
the decoder layers whose last name is a target (MoE experts' excepted). B is random too (a fresh PEFT adapter's B is
zeros, which would hide a dropped adapter); A B is of the base weights' order, as a trained
adapter's is. Python API: make_adapter(model_dir, out, **options) -> the config written.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from safetensors_write import write_raw  # noqa: E402

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_LAYER = re.compile(r"\.layers\.\d+\.")


def _modules(model_dir: Path, targets) -> dict[str, tuple]:
    """module -> (N, K) of the checkpoint's 2-D layer linears named by a target."""
    from infc.compiler.contract.safetensors_io import Checkpoint
    ckpt = Checkpoint(model_dir)
    try:
        out = {}
        for name in sorted(ckpt.where):
            # MoE experts take no adapter in infc (their stacks are no linears: add_lora)
            if not (name.endswith(".weight") and _LAYER.search(name)) or ".experts." in name:
                continue
            module = name[:-len(".weight")]
            shape = ckpt.shape(name)
            if module.rsplit(".", 1)[-1] in targets and len(shape) == 2:
                out[module] = tuple(shape)
        return out
    finally:
        ckpt.close()


def _bf16_bits(a: np.ndarray) -> np.ndarray:
    b = np.asarray(a, np.float32).view(np.uint32).astype(np.uint64)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def make_adapter(model_dir, out, rank: int = 16, alpha: float = 32, rslora: bool = False,
                 targets=DEFAULT_TARGETS, rank_pattern: dict | None = None,
                 alpha_pattern: dict | None = None, seed: int = 0, dtype: str = "f32",
                 std: float = 0.1) -> dict:
    model_dir, out = Path(model_dir), Path(out)
    rank_pattern, alpha_pattern = dict(rank_pattern or {}), dict(alpha_pattern or {})
    modules = _modules(model_dir, set(targets))
    if not modules:
        raise ValueError(f"{model_dir}: no layer linear is named by {sorted(targets)}")
    gen = np.random.default_rng(seed)
    tensors = {}
    for m, (n, k) in sorted(modules.items()):
        r = rank_pattern.get(m.rsplit(".", 1)[-1], rank)
        for ab, shape in (("A", (r, k)), ("B", (n, r))):
            a = (gen.standard_normal(shape) * std).astype(np.float32)
            tensors[f"base_model.model.{m}.lora_{ab}.weight"] = ("F32", a) if dtype == "f32" else ("BF16", _bf16_bits(a))
    out.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(model_dir),
              "r": rank, "lora_alpha": alpha, "use_rslora": rslora, "lora_dropout": 0.0,
              "target_modules": sorted(set(targets)), "rank_pattern": rank_pattern,
              "alpha_pattern": alpha_pattern, "bias": "none", "fan_in_fan_out": False,
              "use_dora": False, "modules_to_save": None, "inference_mode": True}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    write_raw(out / "adapter_model.safetensors", tensors)
    return config


def _pattern(items) -> dict:
    out = {}
    for it in items or ():
        k, _, v = it.partition("=")
        out[k] = float(v) if "." in v else int(v)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="the base model directory (its safetensors give the shapes)")
    p.add_argument("--out", required=True)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32)
    p.add_argument("--rslora", action="store_true", help="scale alpha / sqrt(r) (use_rslora)")
    p.add_argument("--targets", nargs="+", default=list(DEFAULT_TARGETS))
    p.add_argument("--rank-pattern", nargs="*", metavar="MODULE=R")
    p.add_argument("--alpha-pattern", nargs="*", metavar="MODULE=ALPHA")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    a = p.parse_args(argv)
    make_adapter(a.model, a.out, a.rank, a.alpha, a.rslora, a.targets, _pattern(a.rank_pattern),
                 _pattern(a.alpha_pattern), a.seed, a.dtype)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
