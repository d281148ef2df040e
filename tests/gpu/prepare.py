"""Run HERE (no GPU) before a GPU session: build the artifacts the GPU suite needs, with cubins.

    python tests/gpu/prepare.py [PART ...]   # then carry .cache/gpu, .cache/artifacts (and .whl)

PART: base (the served qwen3-4b / llama-3.2-1b, tiny-moe, skipgram, the Qwen tokenizer), nofuse
(qwen3-4b built with --no-fuse into .cache/gpu/qwen3-4b-nofuse-art, from the same config.json as
the served qwen3-4b), families (each family of gpu_families.selected(): its config.json as
transformers writes it into .cache/gpu/configs/<name>/, the artifact into .cache/gpu/<name>-art;
INFC_GPU_FAMILIES picks them, the same variable the GPU suite reads), qwen35 (the full 32-layer
Qwen3.5-4B for session.sh's `qwen35` latency stage with dummy weights: its config.json as
transformers writes it for the text-only Qwen3_5ForCausalLM into .cache/gpu/configs/qwen3.5-4b/,
the artifact into .cache/gpu/qwen3.5-4b-art, and qwen3-4b's config-only directory
.cache/gpu/configs/qwen3-4b/ for the same benchmark beside it, whose artifact base builds).
Default: base, nofuse and families.

The tiny qwen3_moe and the
tiny trained Llama (tests/gpu/trained_model.py) exist only as configs here (.cache/gpu/<name>/)
and their artifacts are built beside them.
`LLM(device="cuda")` and `infc serve` build (or reuse) .cache/artifacts/<model dir name> from the
directory's config.json: those are built here from the same config.json the GPU machine's random
model directories get, for both tuning tables, so the GPU machine compiles nothing. The Qwen
tokenizer files (tokenizer.json, tokenizer_config.json) go to .cache/gpu/qwen-tokenizer for the
server suite on the GPU.
"""
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))

TINY_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
            "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128,
            "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
            "head_dim": 64, "num_experts": 16, "num_experts_per_tok": 4, "norm_topk_prob": True,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 4096,
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
            "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False,
            "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}
GPU_CACHE = REPO / ".cache" / "gpu"
SERVED = ("qwen3-4b", "llama-3.2-1b")          # model directories LLM / infc serve load on the GPU
PARTS = ("base", "nofuse", "families", "qwen35")
DEFAULT_PARTS = ("base", "nofuse", "families")


def _size(d: Path) -> str:
    return f"{sum(f.stat().st_size for f in d.rglob('*') if f.is_file()) / 2**20:.1f} MiB"


def _both_tunings(what: str, out: Path, **kw):
    """Build for the H100 then the H200 table into one directory (bin/ keeps both kernels'
    cubins where the tables differ; plan.json is the H200 one), and say what it took."""
    import shutil
    import time
    from infc.compiler.build import build
    t0 = time.time()
    shutil.rmtree(out, ignore_errors=True)        # no stale cubins carried (they come from the cache)
    for gpu in ("h100", "h200"):
        build(out=out, gpu=gpu, log=None, **kw)
    print(f"[prepare] {what}: {time.time() - t0:.1f} s, {_size(out)} -> {out}", flush=True)


def main(parts=DEFAULT_PARTS):
    for p in parts:
        if p not in PARTS:
            raise SystemExit(f"unknown part '{p}' (known: {', '.join(PARTS)})")
    if "base" in parts:
        base()
    if "nofuse" in parts:
        nofuse()
    if "families" in parts:
        families()
    if "qwen35" in parts:
        qwen35()


def served_config(name: str) -> Path:
    """The config.json the GPU machine's random model directory of `name` gets."""
    from infc.compiler.spec import find_variant
    from make_random_model import write_config
    spec, config = find_variant(name)
    d = GPU_CACHE / "configs" / name
    write_config(spec, config, d)
    return d


def nofuse():
    _both_tunings("qwen3-4b --no-fuse", GPU_CACHE / "qwen3-4b-nofuse-art",
                  model_dir=str(served_config("qwen3-4b")), fuse=False)


def families():
    sys.path.insert(0, str(REPO / "tests" / "gpu"))
    import gpu_families
    for name in gpu_families.selected():
        d = gpu_families.write_config(name)
        _both_tunings(f"{name} ({gpu_families.FAMILIES[name][0]})", gpu_families.artifact_dir(name),
                      model_dir=str(d))


def qwen35():
    sys.path.insert(0, str(REPO / "tests" / "gpu"))
    import gpu_families
    d = gpu_families.write_config("qwen3.5-4b")         # gpu_families.LATENCY
    _both_tunings("qwen3.5-4b (32 layers, latency with dummy weights)",
                  gpu_families.artifact_dir("qwen3.5-4b"), model_dir=str(d))
    served_config("qwen3-4b")                           # its artifact: base's .cache/artifacts/qwen3-4b


def base():
    from infc.compiler.build import REPO as BUILD_REPO, build
    from make_random_model import write_tokenizer
    cfg_dir = GPU_CACHE / "tiny-moe"
    cfg_dir.mkdir(parents=True, exist_ok=True)
    (cfg_dir / "config.json").write_text(json.dumps(TINY_MOE, indent=1))
    build(model_dir=str(cfg_dir), out=GPU_CACHE / "tiny-moe-art")
    sys.path.insert(0, str(REPO / "tests" / "gpu"))
    from trained_model import config_json                 # trained on the GPU machine
    cfg_dir = GPU_CACHE / "skipgram"
    cfg_dir.mkdir(parents=True, exist_ok=True)
    (cfg_dir / "config.json").write_text(json.dumps(config_json(), indent=1))
    build(model_dir=str(cfg_dir), out=GPU_CACHE / "skipgram-art")
    for gpu in ("h100", "h200"):                              # LLM(device="cuda") on it
        build(model_dir=str(cfg_dir), out=BUILD_REPO / ".cache" / "artifacts" / "skipgram", gpu=gpu, log=None)
    for name in SERVED:
        d = served_config(name)
        for gpu in ("h100", "h200"):
            build(model_dir=str(d), out=BUILD_REPO / ".cache" / "artifacts" / name, gpu=gpu, log=None)
    write_tokenizer("qwen3", GPU_CACHE / "qwen-tokenizer", "qwen")


if __name__ == "__main__":
    main(sys.argv[1:] or DEFAULT_PARTS)
