"""Model directories and artifacts for the GPU suite: random weights made on the GPU machine
(no hub, no copying gigabytes), one tiny model trained there (trained_model.py), artifacts
built on the CPU machine (tests/gpu/prepare.py). The new families' directories are made by
transformers itself on the GPU (gpu_families.py)."""
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_families  # noqa: E402

MODELS = Path(os.environ.get("INFC_GPU_MODELS", "/tmp/infc-models"))
# qwen3-4b and llama-3.2-1b: the artifacts `infc serve` / LLM load (prepare.py builds them with
# both tuning tables; plan.json is the H200 one), so the golden gate checks what is served.
ARTIFACTS = {"qwen3-4b": REPO / ".cache" / "artifacts" / "qwen3-4b",
             "llama-3.2-1b": REPO / ".cache" / "artifacts" / "llama-3.2-1b",
             "tiny-moe": REPO / ".cache" / "gpu" / "tiny-moe-art",
             "skipgram": REPO / ".cache" / "gpu" / "skipgram-art",
             # qwen3-4b built with --no-fuse (every op its generic kernel), same weights
             "qwen3-4b-nofuse": REPO / ".cache" / "gpu" / "qwen3-4b-nofuse-art",
             **{f: gpu_families.artifact_dir(f) for f in gpu_families.FAMILIES}}
SAME_WEIGHTS = {"qwen3-4b-nofuse": "qwen3-4b"}     # an artifact name -> the model it runs
# issue 42: quantized checkpoints written here from a bf16 random model (tools/quantize_model.py;
# no hub, nothing carried), name -> (the bf16 model, the writer's format, its options), and their
# artifacts, from prepare.py quant (its QUANT_FORMATS is this table)
from prepare import QUANT_FORMATS as QUANTIZED  # noqa: E402
ARTIFACTS.update({name: REPO / ".cache" / "artifacts" / name for name in QUANTIZED})


QWEN_TOKENIZER = REPO / ".cache" / "gpu" / "qwen-tokenizer"     # made by prepare.py


def model_dir(name: str) -> Path:
    """Random-weight HF directory at the model's exact shapes (made once per machine); the
    qwen3 ones get the Qwen tokenizer (the server suite needs text)."""
    name = SAME_WEIGHTS.get(name, name)
    out = MODELS / name
    if not ((out / "config.json").exists() and any(out.glob("*.safetensors"))):
        _make(name, out)
    if name.startswith("qwen3-") and QWEN_TOKENIZER.is_dir() and not (out / "tokenizer.json").exists():
        import shutil
        for f in QWEN_TOKENIZER.iterdir():
            shutil.copyfile(f, out / f.name)
    return out


def _make(name: str, out: Path):
    if name in QUANTIZED:
        import time
        from quantize_model import quantize_model
        base, fmt, options = QUANTIZED[name]
        t0 = time.time()
        quantize_model(model_dir(base), out, fmt, **options)
        print(f"[models] {name}: {base} quantized as {fmt} in {time.time() - t0:.1f} s", flush=True)
        return
    if name == "skipgram":
        from trained_model import ensure_trained
        ensure_trained(out)
        return
    if name in gpu_families.FAMILIES:
        gpu_families.make_model(name, out)
        return
    from make_random_model import write_random_model
    from infc.compiler.spec import find_architecture, find_variant
    import prepare
    import prepare_moe
    if name == "tiny-moe":
        config = json.loads((REPO / ".cache" / "gpu" / "tiny-moe" / "config.json").read_text())
        spec = find_architecture(config["architectures"])
    elif name in prepare_moe.CUTS or prepare.CUT.match(name):
        # a cut: its config.json from prepare_moe.py or prepare.py's base_config (carried)
        config = json.loads((prepare_moe.GPU_CACHE / "configs" / name / "config.json").read_text())
        spec = find_architecture(config["architectures"])
    else:
        spec, config = find_variant(name)
    write_random_model(spec, config, out, seed=0, dtype="bf16", tokenizer=None)


def remove(name: str):
    """Delete a family's model directory once its tests are done (disk: the default families
    weigh ~30 GiB); INFC_GPU_KEEP_MODELS=1 keeps them for another run in the same session."""
    if name in gpu_families.FAMILIES and not os.environ.get("INFC_GPU_KEEP_MODELS"):
        import shutil
        shutil.rmtree(MODELS / name, ignore_errors=True)


def artifact(name: str) -> Path:
    a = ARTIFACTS[name]
    if not (a / "bin").is_dir():
        raise FileNotFoundError(f"{a}/bin missing: run tests/gpu/prepare.py and carry it")
    return a
