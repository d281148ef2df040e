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
.cache/gpu/configs/qwen3-4b/ for the same benchmark beside it, whose artifact base builds), ranks
(tests/gpu/test_ranks_gpu.py, session.sh's `ranks` stage: a tiny qwen3 and a tiny qwen3_moe,
their configs in .cache/gpu/ranks/configs/<name>/, each built whole, with
--tensor-parallel-size 2, and for the MoE also with --enable-expert-parallel (TP x EP) and
expert-parallel only, plus one-rank plans (world 1) that still carry the collectives, for the
one-rank NCCL path: ranks_artifact()), deepseek (issue 13, session.sh's `families` stage with
INFC_GPU_FAMILIES=deepseek-v2-lite-l8 and its `deepseek` stage: the 8-layer cut of DeepSeek-V2-Lite
for the golden gate and the full 27 layers for latency with dummy weights, each config.json as
transformers writes it into .cache/gpu/configs/<name>/ and its artifact in .cache/gpu/<name>-art),
twogpu (issue 14, tests/gpu/test_two_gpus.py and session.sh's `twogpu` stage: the parallel builds
one process per GPU runs, named as `infc serve --tensor-parallel-size 2 [--enable-expert-parallel]`
names them for the GPU machine's model directories, in .cache/artifacts/<dir name>-tp2[-ep2]
(TWOGPU), with the one-GPU builds of the same configs beside them for the same-commit baselines),
server (session.sh's `server-families` stage: the openai SDK suite over the Qwen3.5 and
DeepSeek-V2-Lite cuts, gpu_families.SERVER: their configs in .cache/gpu/configs/<name>-server, the
artifacts `infc serve` reuses in .cache/artifacts/<name>-server), attnvar (issue 10: qwen3-4b with
variants of attention_mixed's split-role tunables laid over the tables, ATTN_VARIANTS, into
.cache/artifacts/qwen3-4b-attn-<name>, for tests/gpu/run.sh attn-variants), hlvar (issue 13:
DeepSeek-V2-Lite with other head_linear blocks, HL_VARIANTS, into
.cache/artifacts/deepseek-v2-lite-<name>, beside deepseek-v2-lite, for run.sh ab-latency),
quant (issue 42, session.sh's `quant` stage: qwen3-4b's and the qwen3-30b-a3b 4-layer cut's
config.json with the quantization_config tools/quantize_model.py writes for QUANT_FORMATS (fp8
blocks; the cut's experts too), and the whole qwen3-30b-a3b's for QUANT_DUMMY (timed with dummy
weights), config-only, into .cache/gpu/configs/<name>/,
the artifact `infc serve` reuses for the device's $MODELS/<name> into .cache/artifacts/<name>;
where the kernels refuse to render a quantized launch yet, plan.json alone, said so).
kvfp8 (issue 42, session.sh's `kv-fp8` stage: qwen3-4b built with --kv-cache-dtype fp8 into
.cache/artifacts/qwen3-4b-kvfp8, beside base's qwen3-4b).
dsv4 (issue 47, session.sh's `dsv4` stage: DeepSeek-V4-Flash's 3-layer cut at real widths,
gpu_families.DSV4_CUT, its config.json as transformers writes it into .cache/gpu/configs/<cut>/ and
its artifact in .cache/gpu/<cut>-art, for the golden gate and bench latency with dummy weights).
verify-ab (issue 43: qwen3-4b's verify program (5 rows) with its GEMVs in each form of VERIFY_AB,
into .cache/artifacts/qwen3-4b-v5-<form>, for `bench spec-verify` / `bench profile` A/Bs);
verify-8b: qwen3-8b's, as the committed tables render it, into .cache/artifacts/qwen3-8b-v5.
draft-8b (issue 43: qwen3-8b drafted by qwen3-0.6b, config-only, for `bench spec-e2e`).
grid-ab (issues 43 and 49: qwen3-4b as served with every GEMV's grid the blocks of the path its rows
take (tune GRID "paths", lm_head_last's too) into .cache/artifacts/qwen3-4b-paths, beside base's
qwen3-4b, for `bench throughput` / `bench profile` A/Bs of plain serving).
lora (issue 46, session.sh's `lora` stage: qwen3-4b built with --enable-lora, 8 slots of rank 16,
into .cache/artifacts/qwen3-4b-lora8r16, beside base's qwen3-4b); lora-rows / lora-expand: the same
with a decode step's sites / expands in its GEMVs (-rows, -expand: A/B sides).
fp8-ab (issue 42: qwen3-4b-fp8's config, config-only, built three ways for a narrow-step A/B with
dummy weights: .cache/artifacts/qwen3-4b-fp8 as served, -merge with the norms merged into the narrow
GEMVs (infc/config.py NARROW_MERGE_QUANT_NORMS), -noac without the act_codes pass).
draft (issue 43, tests/gpu/test_spec_gpu.py's draft-model case: qwen3-4b's first two layers as a
draft model, config-only in .cache/gpu/configs/qwen3-4b-l2, built into
.cache/artifacts/qwen3-4b-l2, the artifact infc/backend.py reuses for a draft directory of that
name; its kernels are qwen3-4b's, so the kernel cache compiles nothing new after base).
eagle3 (issue 43, tests/gpu/test_spec_gpu.py's EAGLE-3 case: a config-only EAGLE-3 head for
qwen3-4b (tools/make_eagle3_head.head_config, a draft vocabulary of 32000) in
.cache/gpu/configs/eagle3-qwen3-4b, built from specs/eagle3.yaml into
.cache/artifacts/eagle3-qwen3-4b-eagle3, and qwen3-4b built with the head's hidden states as a
plan output into .cache/artifacts/qwen3-4b-eagle3-<layers>: the artifacts infc/backend.py reuses).
mtp (issue 43, tests/gpu/test_spec_mtp_gpu.py, `-m mtp`: DeepSeek-V3's 5-layer cut declaring one
MTP layer, config-only in .cache/gpu/configs/deepseek-v3-l5-mtp, and the three artifacts
infc/backend.py reuses for it on cuda, named as it names them: the plain build
(.cache/artifacts/deepseek-v3-l5-mtp), the speculative one with the last hidden state as a plan
output (deepseek-v3-l5-mtp-eagle3-5, -narrow4 first under INFC_VERIFY_PROGRAM=1) and the MTP layer's
own (deepseek-v3-l5-mtp-mtp)). Not in the default: the cut is at the published widths.
Default: base, nofuse, families, draft and eagle3.

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
import re
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
PARTS = ("base", "nofuse", "families", "qwen35", "ranks", "deepseek", "twogpu", "server", "attnvar", "hlvar", "kvfp8",
         "quant", "lora", "lora-rows", "lora-expand", "fp8-ab", "verify-ab", "verify-8b", "grid-ab", "draft", "draft-8b", "eagle3", "mtp", "gptoss",
         "dsv4")
DEFAULT_PARTS = ("base", "nofuse", "families", "draft", "eagle3")


def _size(d: Path) -> str:
    return f"{sum(f.stat().st_size for f in d.rglob('*') if f.is_file()) / 2**20:.1f} MiB"


def _both_tunings(what: str, out: Path, model_dir: str, **kw):
    """Build for the H100 then the H200 table into one directory (bin/ keeps both kernels'
    cubins where the tables differ; plan.json is the H200 one), and say what it took. The build's
    arguments go to out/built_from.json, for tests/gpu/rerender.py on the GPU machine."""
    import shutil
    import time
    from infc.compiler.build import build
    sys.path.insert(0, str(REPO / "tests" / "gpu"))
    from build_variants import config_overrides
    t0 = time.time()
    shutil.rmtree(out, ignore_errors=True)        # no stale cubins carried (they come from the cache)
    config = kw.pop("config", {})                 # infc/config.py constants for this build alone
    with config_overrides(config):
        for gpu in ("h100", "h200"):
            build(out=out, gpu=gpu, log=None, model_dir=model_dir, **kw)
    d = Path(model_dir).resolve()              # relative to the repo where it is in it (carried)
    (Path(out) / "built_from.json").write_text(json.dumps(
        {"model_dir": str(d.relative_to(REPO) if d.is_relative_to(REPO) else d), **kw,
         **({"config": config} if config else {})}, indent=1) + "\n")
    print(f"[prepare] {what}: {time.time() - t0:.1f} s, {_size(out)} -> {out}", flush=True)


def stamp_commit():
    """.cache/gpu/configs/COMMIT: the commit these artifacts were built from ("-dirty" when the
    tree had changes). session.sh records it when INFC_COMMIT is unset and warns when a given
    INFC_COMMIT differs (the GPU machine's copy has no usable git metadata, and a hash typed into
    a command can be wrong: one was, on 2026-11-27)."""
    import subprocess
    git = lambda *a: subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True)  # noqa: E731
    head = git("rev-parse", "--short", "HEAD").stdout.strip()
    if not head:
        return
    dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
    out = GPU_CACHE / "configs" / "COMMIT"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(head + ("-dirty" if dirty else "") + "\n")


def main(parts=DEFAULT_PARTS):
    for p in parts:
        if p not in PARTS:
            raise SystemExit(f"unknown part '{p}' (known: {', '.join(PARTS)})")
    stamp_commit()
    if "base" in parts:
        base()
    if "nofuse" in parts:
        nofuse()
    if "families" in parts:
        families()
    if "qwen35" in parts:
        qwen35()
    if "ranks" in parts:
        ranks()
    if "deepseek" in parts:
        deepseek()
    if "twogpu" in parts:
        twogpu()
    if "server" in parts:
        server()
    if "attnvar" in parts:
        attnvar()
    if "hlvar" in parts:
        hlvar()
    if "quant" in parts:
        quant()
    if "kvfp8" in parts:
        kvfp8()
    if "lora" in parts:
        lora()
    if "lora-rows" in parts:
        lora(rows=True)
    if "lora-expand" in parts:
        lora(expand=True)
    if "fp8-ab" in parts:
        fp8_ab()
    if "verify-ab" in parts:
        verify_ab()
    if "verify-8b" in parts:
        verify_8b()
    if "grid-ab" in parts:
        grid_ab()
    if "draft" in parts:
        draft()
    if "draft-8b" in parts:
        draft_8b()
    if "eagle3" in parts:
        eagle3()
    if "mtp" in parts:
        mtp()
    if "gptoss" in parts:
        gptoss()
    if "dsv4" in parts:
        dsv4()


def served_config(name: str) -> Path:
    """The config.json the GPU machine's random model directory of `name` gets."""
    from infc.compiler.spec import find_variant
    from make_random_model import write_config
    spec, config = find_variant(name)
    d = GPU_CACHE / "configs" / name
    write_config(spec, config, d)
    return d


# issue 10's prefix-hit attention (attention_mixed's split role in the short program): variants of
# its tunables, each a qwen3-4b artifact built with the overlay (build's tuning_overlay), for
# tests/gpu/run.sh attn-variants to profile side by side (bench profile --isolate)
ATTN_VARIANTS = {
    "minkeys64": {"SPLIT_MIN_KEYS": 64},              # 1-tile splits (17 at 1k): more programs
    "minkeys2048": {"SPLIT_MIN_KEYS": 2048},          # one split at 1k: no merge at all
    "minkeys128": {"SPLIT_MIN_KEYS": 128},            # 2-tile splits (9 at 1k)
    "chunk1": {"SPLIT_MERGE_CHUNK": 1},               # the merge in 2-D tiles, a split a pass
    "blockn128": {"SPLIT_BLOCK_N": 128},
    # not num_warps 4: the kernel spills then (cuobjdump: 768 bytes of stack)
}


def attn_variant_dir(name: str) -> Path:
    return REPO / ".cache" / "artifacts" / f"qwen3-4b-attn-{name}"


def attnvar():
    d = str(served_config("qwen3-4b"))
    for name, tune in ATTN_VARIANTS.items():
        _both_tunings(f"qwen3-4b, attention_mixed {tune}", attn_variant_dir(name), model_dir=d,
                      tuning_overlay={"attention_mixed": {"default": tune}})


# issue 13: DeepSeek-V2-Lite's absorbed head_linear launches at batch 1, as overlays on the tables
# (which since 2026-11-27 give w_uv 16 x 128 blocks: 64 programs, not the defaults' 32 of 64 x 64),
# into .cache/artifacts/deepseek-v2-lite-<name>, for tests/gpu/run.sh ab-latency against
# deepseek-v2-lite: nouv (the template defaults: the table entry's own A/B), uv32 (32-wide blocks),
# uk32 (w_uk on 32-wide blocks besides)
HL_UV, HL_UK = "decode|Tx16x512;16x128x512;Tx16x128", "decode|Tx16x128;16x512x128;Tx16x512"
HL_VARIANTS = {"nouv": {HL_UV: {"BLOCK_N": 64, "BLOCK_K": 64}}, "uv32": {HL_UV: {"BLOCK_N": 32}},
               "uk32": {HL_UK: {"BLOCK_N": 32}}}


def hlvar():
    cfg = str(_family_config("deepseek-v2-lite"))
    A = REPO / ".cache" / "artifacts"
    _both_tunings("deepseek-v2-lite", A / "deepseek-v2-lite", model_dir=cfg)
    for name, ov in HL_VARIANTS.items():
        _both_tunings(f"deepseek-v2-lite head_linear {name}", A / f"deepseek-v2-lite-{name}",
                      model_dir=cfg, tuning_overlay={"head_linear": ov})


# issue 42: quantized builds. The GPU machine writes the checkpoint (models.QUANTIZED is this
# table: the random bf16 model, quantized there by tools/quantize_model.py); here only its
# config.json, exactly as the writer will write it, and the artifact. name -> (the bf16 model it is
# written from: qwen3-4b, or qwen3-30b-a3b's 4-layer cut of prepare_moe.py with
# Qwen3-30B-A3B-FP8's experts; the writer's format; its options)
QUANT_FORMATS = {"qwen3-4b-fp8": ("qwen3-4b", "fp8-block", {}),
                 "qwen3-4b-w4a16": ("qwen3-4b", "ct-int", {"bits": 4, "group": 128}),
                 "qwen3-30b-a3b-l4-fp8": ("qwen3-30b-a3b-l4", "fp8-block", {}),
                 # the golden gate's fp8 model at qwen3-4b's shapes: two layers, where 36 random
                 # layers amplify the activation quantizer's last-bit flips until the reference
                 # disagrees with itself (bench/results/issue42-h200-c462936-2026-12-02)
                 "qwen3-4b-l2-fp8": ("qwen3-4b-l2", "fp8-block", {}),
                 # Qwen3-8B-AWQ's shapes (GEMM packing, group 128, zero points), four layers
                 "qwen3-8b-l4-awq": ("qwen3-8b-l4", "awq", {"group": 128}),
                 # the MoE cut with Kimi-K2's expert format (int4, symmetric, group 32); with
                 # compiler/passes/upcast_experts.py (on by default) its batched prefills
                 # (>= 1,024 rows) read the experts' bf16 stacks, which the fp8 cut's never do
                 "qwen3-30b-a3b-l4-w4a16": ("qwen3-30b-a3b-l4", "ct-int", {"bits": 4, "group": 32})}
# whole models measured with --load-format dummy (no checkpoint: the GPU machine's disk cannot hold a
# random bf16 Qwen3-30B-A3B and its fp8 copy): config.json with the writer's quantization_config
# alone, the artifact in .cache/artifacts/<name>; session.sh quant times them beside the bf16 build
# (issue 42's qwen3-30b-a3b FP8 batch-1 TPOT <= 1.5 ms)
QUANT_DUMMY = {"qwen3-30b-a3b-fp8": ("qwen3-30b-a3b", "fp8-block", {})}
CUT = re.compile(r"^(.+)-l(\d+)$")       # <served model>-l<layers>: its first layers alone


def base_config(base: str) -> Path:
    """The directory of the config.json the GPU machine's random model `base` gets (a cut
    <variant>-l<N> of a served variant: its config with N layers)."""
    import prepare_moe
    if base in prepare_moe.CUTS:
        return prepare_moe.write_config(base)
    cut = CUT.match(base)
    if cut is None:
        return served_config(base)
    cfg = json.loads((served_config(cut.group(1)) / "config.json").read_text())
    cfg.update(num_hidden_layers=int(cut.group(2)), max_window_layers=int(cut.group(2)))
    return _write_config(base, cfg)


def _write_config(name: str, cfg: dict) -> Path:
    """.cache/gpu/configs/<name>/config.json holding cfg; returns its directory."""
    d = GPU_CACHE / "configs" / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return d


def moe_routers(cfg: dict) -> list:
    """The router modules (Qwen3-MoE's model.layers.N.mlp.gate, in its sparse layers) that
    tools/quantize_model.py leaves bf16 and lists in the ignore list, in its order."""
    if not (cfg.get("num_experts") or cfg.get("num_local_experts")):      # (transformers 5 writes the latter)
        return []
    step, dense = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or [])
    return sorted(f"model.layers.{i}.mlp.gate" for i in range(cfg["num_hidden_layers"])
                  if i not in dense and (i + 1) % step == 0)


def quant_config(name: str) -> Path:
    """.cache/gpu/configs/<name>/config.json: the base model's, with the writer's quantization_config."""
    from quantize_model import quantization_config
    base, fmt, options = {**QUANT_FORMATS, **QUANT_DUMMY}[name]
    cfg = json.loads((base_config(base) / "config.json").read_text())
    cfg["quantization_config"] = quantization_config(fmt, options, moe_routers(cfg))
    return _write_config(name, cfg)


def quant(artifacts: Path | None = None):
    """artifacts: where the builds go (default .cache/artifacts, where `infc serve` finds them)."""
    from infc.compiler.build import REPO as BUILD_REPO, compile_model
    from infc.compiler.codegen.render import TemplateError
    from infc.compiler.plan import dumps
    for name in [*QUANT_FORMATS, *QUANT_DUMMY]:
        d, out = quant_config(name), (artifacts or BUILD_REPO / ".cache" / "artifacts") / name
        try:
            _both_tunings(f"{name} (config only; the checkpoint is written on the GPU)", out,
                          model_dir=str(d), check_checkpoint=False)
        except TemplateError as e:
            # the quantized kernels are not there yet: the plan alone shows the stage's plumbing
            # (infc inspect reads it), and the GPU stage says it has nothing to run
            _, plan = compile_model(model_dir=str(d), check_checkpoint=False)
            out.mkdir(parents=True, exist_ok=True)
            (out / "plan.json").write_text(dumps(plan))
            print(f"[prepare] {name}: the kernels refuse a quantized launch ({e}); wrote {out}/plan.json "
                  f"alone, no kernels or cubins: session.sh quant will skip its GPU steps", flush=True)


def kvfp8():
    """qwen3-4b with --kv-cache-dtype fp8, from the served qwen3-4b's config.json, into
    .cache/artifacts/qwen3-4b-kvfp8: session.sh's `kv-fp8` stage times it beside the bf16-KV
    artifact on the same model directory (issue 42: FP8 KV decode at 32k within 10 % of 1k)."""
    from infc.compiler.build import REPO as BUILD_REPO
    _both_tunings("qwen3-4b --kv-cache-dtype fp8", BUILD_REPO / ".cache" / "artifacts" / "qwen3-4b-kvfp8",
                  model_dir=str(served_config("qwen3-4b")), kv_cache_dtype="fp8",
                  check_checkpoint=False)     # (the random model has no k_scale / v_scale: 1.0, as here)


def lora(rows: bool = False, expand: bool = False):
    """qwen3-4b with --enable-lora --max-loras 8 --max-lora-rank 16, from the served qwen3-4b's
    config.json, into .cache/artifacts/qwen3-4b-lora8r16: the directory `infc serve --enable-lora`
    and `bench throughput --enable-lora` reuse for $MODELS/qwen3-4b with those flags (infc/backend.py
    names it), and tests/gpu/test_lora_gpu.py's artifact (session.sh's `lora` stage).
    rows: the same with a decode step's sites inside its GEMVs (infc/config.py LORA_DECODE_SITES
    True), into qwen3-4b-lora8r16-rows: the other side of that A/B (session.sh's `lora-profile`
    with LORA_PROFILE_ARTS). expand: a decode step's expands alone in its GEMVs, the shrinks launched
    apart (LORA_DECODE_EXPAND), into qwen3-4b-lora8r16-expand."""
    from infc.backend import SERVED_ARTIFACTS
    from infc.config import artifact_tag, lora_build
    lora = lora_build(8, 16)
    # (directory suffix, what the build is, its infc/config.py switch)
    variant, what, config = (("-rows", ", decode sites in the GEMVs", {"LORA_DECODE_SITES": True}) if rows else
                             ("-expand", ", decode expands in the GEMVs", {"LORA_DECODE_EXPAND": True}) if expand else
                             ("", "", {}))
    out = SERVED_ARTIFACTS / ("qwen3-4b" + artifact_tag(lora) + variant)
    _both_tunings("qwen3-4b --enable-lora (8 slots, rank 16)" + what, out,
                  model_dir=str(served_config("qwen3-4b")), lora=lora, check_checkpoint=False, config=config)


def fp8_ab():
    """qwen3-4b-fp8 (config only: `--load-format dummy` on the GPU) as served, with its narrow norms
    merged into the GEMVs (NARROW_MERGE_QUANT_NORMS), without act_codes (build skip), and with every
    GEMV (-n32) or gate|up alone (-gu32) at 32 W rows x 256 columns a step (72 registers on sm_90
    against the default's 164: 7 programs an SM, not 3), and with split-K partials parked by plain
    stores (-park: gemv.py.j2 PARK), into .cache/artifacts/qwen3-4b-fp8[-merge|-noac|-n32|-gu32|-park]:
    `bench profile --artifact` of each."""
    from infc.backend import SERVED_ARTIFACTS
    d = str(quant_config("qwen3-4b-fp8"))
    n32 = {"BLOCK_N": 32, "FMA_BLOCK_K": 256}
    for tag, kw in (("", {}), ("-merge", {"config": {"NARROW_MERGE_QUANT_NORMS": True}}),
                    ("-noac", {"skip": ["act_codes"]}),
                    ("-n32", {"tuning_overlay": {t: {"default": n32} for t in ("gemv", "gemv_gated")}}),
                    ("-gu32", {"tuning_overlay": {"gemv_gated": {"default": n32}}}),
                    ("-park", {"tuning_overlay": {t: {"default": {"PARK": "store"}} for t in ("gemv", "gemv_gated")}})):
        _both_tunings(f"qwen3-4b-fp8{tag}", SERVED_ARTIFACTS / f"qwen3-4b-fp8{tag}", model_dir=d,
                      check_checkpoint=False, **kw)


def _every_gemv(entry: dict) -> dict:
    """A tuning overlay that gives every GEMV-based template (gemv, gemv_gated, lm_head_last) the
    tunables `entry` in its "default" entry."""
    return {t: {"default": dict(entry)} for t in ("gemv", "gemv_gated", "lm_head_last")}


# issue 43's verify GEMVs (qwen3-4b, 5 rows: k = 4) in each form of the A/B, the same on both tables:
# "old" the H100 table's entries before the row pass was unrolled (gate|up's rows in one loop over
# [BLOCK_T, 128] chunks); "rows" the same with the unrolled row pass; "rowsq" q|k|v on the
# tensor-core path too; "probe" every GEMV at the bare skinny GEMM's best tiles on an H100
# (tools/experiments/skinny_gemm_probe.py: 64 W rows, BLOCK_K / K splits / stages per shape). q|k|v's
# one-row CUDA-core tile (never taken by a verify step, compiled into its kernel) at 16 x 256, not
# 16 x 512: its 167 registers would set the tensor-core path's occupancy
_VQ, _VO = "verify|Tx2560;6144x2560;Tx6144|r5", "verify|Tx4096;2560x4096;Tx2560|r5"
_VD, _VGU = "verify|Tx9728;2560x9728;Tx2560|r5", "verify|Tx2560;19456x2560;Tx9728|r5"
# Each form names every key the H100 table's verify entries set since 2026-12-07 (the template's
# defaults at these shapes where the form had none: FMA_T 5, BLOCK_T 32, the auto K splits, 4
# stages, the narrow entries' CUDA-core tiles), since an overlay is laid over the table's entry, not
# in place of it: on the H100 table each form renders the kernels its run measured (the same ids)
_D = {"BLOCK_T": 32, "num_stages": 4, "DOT_PRE": 0, "ROW_SUMS": "end"}
_V_OLD = {"gemv": {_VQ: {**_D, "ROW_SUMS": "chain", "FMA_T": 5, "BLOCK_K": 64, "SPLIT_K_DOT": 2, "FMA_BLOCK_K": 256},
                   _VO: {**_D, "BLOCK_K": 128, "FMA_T": 1, "SPLIT_K_DOT": 4, "FMA_BLOCK_K": 1024},
                   _VD: {**_D, "BLOCK_K": 128, "FMA_T": 1, "SPLIT_K_DOT": 6, "FMA_BLOCK_K": 512}},
          "gemv_gated": {_VGU: {**_D, "FMA_T": 1, "ROW_PASS": "block", "BLOCK_K": 64, "SPLIT_K_DOT": 1,
                                "FMA_BLOCK_K": 128}}}
_TC = {"FMA_T": 1, "ROW_SUMS": "end", "BLOCK_T": 16, "DOT_PRE": 0}
VERIFY_AB = {
    "old": _V_OLD,
    "rows": {**_V_OLD, "gemv_gated": {_VGU: {**_V_OLD["gemv_gated"][_VGU], "ROW_PASS": "rows"}}},
    "rowsq": {"gemv": {**_V_OLD["gemv"], _VQ: {**_V_OLD["gemv"][_VQ], "FMA_T": 1, "ROW_SUMS": "end"}},
              "gemv_gated": {_VGU: {**_V_OLD["gemv_gated"][_VGU], "ROW_PASS": "rows"}}},
    "probe": {"gemv": {_VQ: {**_TC, "BLOCK_K": 128, "SPLIT_K_DOT": 4, "num_stages": 3, "FMA_BLOCK_K": 256},
                       _VO: {**_TC, "BLOCK_K": 64, "SPLIT_K_DOT": 8, "num_stages": 4},
                       _VD: {**_TC, "BLOCK_K": 64, "SPLIT_K_DOT": 8, "num_stages": 4}},
              "gemv_gated": {_VGU: {**_TC, "ROW_PASS": "rows", "BLOCK_K": 128, "SPLIT_K_DOT": 2, "num_stages": 3}}},
}
# "pre": the probe's tiles with two W tiles read before the PDL wait (DOT_PRE); "best": pre with
# gate|up unsplit (the H100 table's verify entries since 2026-12-07: verify(4) 4.04-4.06 ms on an H100)
VERIFY_AB["pre"] = {t: {k: {**v, "DOT_PRE": 2} for k, v in e.items()} for t, e in VERIFY_AB["probe"].items()}
VERIFY_AB["best"] = {"gemv": VERIFY_AB["pre"]["gemv"],
                     "gemv_gated": {_VGU: {**VERIFY_AB["pre"]["gemv_gated"][_VGU], "SPLIT_K_DOT": 1}}}
# "best-paths": best with every GEMV's grid the taken path's blocks (GRID "paths"; the "default"
# entries reach the decode program's GEMVs too, whose steps of more rows than FMA_T take the
# tensor-core path)
VERIFY_AB["best-paths"] = {t: {**e, "default": {"GRID": "paths"}} for t, e in VERIFY_AB["best"].items()}
# "n16": best with q|k|v, o and down on 16-row W blocks for the tensor-core path (BLOCK_N_DOT 16),
# q|k|v unsplit (384 programs) and o / down in 2 splits (320): fewer K splits, so less of the split
# finish (a parked partial, the counter, the last program's sum) that cost gate|up ~7 us (#15's call
# 3), with as many programs; "n16u": all three unsplit (o and down 160 programs)
_N16 = {_VQ: {"BLOCK_N_DOT": 16, "SPLIT_K_DOT": 1}, _VO: {"BLOCK_N_DOT": 16, "SPLIT_K_DOT": 2},
        _VD: {"BLOCK_N_DOT": 16, "SPLIT_K_DOT": 2}}
VERIFY_AB["n16"] = {**VERIFY_AB["best"], "gemv": {k: {**v, **_N16[k]} for k, v in VERIFY_AB["best"]["gemv"].items()}}
VERIFY_AB["n16u"] = {**VERIFY_AB["best"], "gemv": {k: {**v, **_N16[k], "SPLIT_K_DOT": 1}
                                                   for k, v in VERIFY_AB["best"]["gemv"].items()}}
# "default": the committed table as it is (on a table without verify entries, the H200's, the
# template's VERIFY_DOT form); "lanes": every verify launch on the CUDA-core rows (FMA_T "rows"), the
# form a table without verify entries ran before VERIFY_DOT
VERIFY_AB["default"] = {}
VERIFY_AB["lanes"] = _every_gemv({"FMA_T": "rows"})
# "default-paths": the table as it is with every GEMV's grid the taken path's blocks (GRID "paths":
# in the verify program every step's rows take the tensor-core path, so the CUDA-core path's extra
# column programs only enter and exit; #17's ncu count)
VERIFY_AB["default-paths"] = _every_gemv({"GRID": "paths"})


def verify_ab():
    """qwen3-4b with a verify program of 5 rows (k = 4) for each VERIFY_AB form, config-only
    (dummy weights on the GPU), into .cache/artifacts/qwen3-4b-v5-<form>: `bench spec-verify` and
    `bench profile --steps verify_b1` of each."""
    from infc.backend import SERVED_ARTIFACTS
    for tag, overlay in VERIFY_AB.items():
        _both_tunings(f"qwen3-4b-v5-{tag}", SERVED_ARTIFACTS / f"qwen3-4b-v5-{tag}",
                      model_dir=str(served_config("qwen3-4b")), narrow_tokens=5, check_checkpoint=False,
                      tuning_overlay=overlay)


def verify_8b():
    """qwen3-8b with a verify program of 5 rows (k = 4), config-only, into
    .cache/artifacts/qwen3-8b-v5: issue 43's verify table for its second model (`bench spec-verify`)."""
    from infc.backend import SERVED_ARTIFACTS
    _both_tunings("qwen3-8b-v5", SERVED_ARTIFACTS / "qwen3-8b-v5", model_dir=str(served_config("qwen3-8b")),
                  narrow_tokens=5, check_checkpoint=False)


def grid_ab():
    """qwen3-4b as served, with GRID "paths" on every GEMV-based template (gemv, gemv_gated,
    lm_head_last), into .cache/artifacts/qwen3-4b-paths: the A/B side of base's qwen3-4b."""
    from infc.backend import SERVED_ARTIFACTS
    overlay = _every_gemv({"GRID": "paths"})
    _both_tunings("qwen3-4b-paths", SERVED_ARTIFACTS / "qwen3-4b-paths", model_dir=str(served_config("qwen3-4b")),
                  check_checkpoint=False, tuning_overlay=overlay)


DRAFT_CUT = "qwen3-4b-l2"      # tests/gpu/test_spec_gpu.py's DRAFT_CUT


def draft():
    """qwen3-4b-l2 (base_config: qwen3-4b's config.json with 2 layers) into
    .cache/artifacts/qwen3-4b-l2, with the config-only directories of it and of qwen3-4b that the
    GPU test loads with --load-format dummy; and the target's speculative build (k = 4; with
    INFC_VERIFY_PROGRAM=1 a verify program of 5 rows, infc/config.py narrow_tokens_for) into the
    directory infc/backend.py names for it (qwen3-4b-narrow5 then, else the plain qwen3-4b)."""
    from types import SimpleNamespace
    from infc.backend import SERVED_ARTIFACTS
    from infc.config import artifact_tag
    from infc.compiler.build import REPO as BUILD_REPO
    from infc.config import narrow_tokens_for
    # 1 (the plain build) unless INFC_VERIFY_PROGRAM=1 here and on the GPU machine
    n = narrow_tokens_for(SimpleNamespace(num_speculative_tokens=4))
    _both_tunings(f"qwen3-4b for --speculative-config k = 4 (narrow_tokens {n})",
                  SERVED_ARTIFACTS / ("qwen3-4b" + artifact_tag(narrow=n)),
                  model_dir=str(served_config("qwen3-4b")), narrow_tokens=n, check_checkpoint=False)
    _both_tunings(f"{DRAFT_CUT} (a draft model for qwen3-4b)", BUILD_REPO / ".cache" / "artifacts" / DRAFT_CUT,
                  model_dir=str(base_config(DRAFT_CUT)), check_checkpoint=False)
    # the trained model's verify program (test_self_draft_on_a_trained_model_is_exact sets
    # INFC_VERIFY_PROGRAM=1 itself: built whatever this machine's setting)
    _both_tunings("skipgram for --speculative-config k = 4 under INFC_VERIFY_PROGRAM=1 (narrow_tokens 5)",
                  SERVED_ARTIFACTS / ("skipgram" + artifact_tag(narrow=5)), model_dir=str(skipgram_config()),
                  narrow_tokens=5)


def draft_8b():
    """qwen3-8b as a draft-model target (k = 4) and qwen3-0.6b as its draft, config-only, for
    `bench spec-e2e` on the GPU: the target's speculative build both ways (the plain build, and
    the verify program of 5 rows INFC_VERIFY_PROGRAM=1 builds) and the draft's one-token build,
    into the directories infc/backend.py names for them."""
    from infc.backend import SERVED_ARTIFACTS
    from infc.config import artifact_tag
    for n in (1, 5):
        _both_tunings(f"qwen3-8b for --speculative-config k = 4 (narrow_tokens {n})",
                      SERVED_ARTIFACTS / ("qwen3-8b" + artifact_tag(narrow=n)),
                      model_dir=str(served_config("qwen3-8b")), narrow_tokens=n, check_checkpoint=False)
    _both_tunings("qwen3-0.6b (a draft model for qwen3-8b)", SERVED_ARTIFACTS / "qwen3-0.6b",
                  model_dir=str(served_config("qwen3-0.6b")), check_checkpoint=False)


EAGLE3_HEAD = "eagle3-qwen3-4b"  # tests/gpu/test_spec_gpu.py's EAGLE3_HEAD


def eagle3():
    """A config-only EAGLE-3 head for qwen3-4b and the two artifacts infc/backend.py builds for
    it on cuda (names as it gives them): the head's (specs/eagle3.yaml, the target's page size)
    and qwen3-4b's with aux_hidden at the head's layers (infc.config.eagle3_default_layers)."""
    from types import SimpleNamespace
    from infc.config import artifact_tag, narrow_tokens_for
    from infc.compiler.build import REPO as BUILD_REPO
    from infc.compiler.spec import SPECS_DIR
    from infc.config import eagle3_default_layers
    from make_eagle3_head import head_config
    target = served_config("qwen3-4b")
    cfg = json.loads((target / "config.json").read_text())
    head = _write_config(EAGLE3_HEAD, head_config(cfg, draft_vocab=32000))
    layers = eagle3_default_layers(cfg["num_hidden_layers"])
    arts = BUILD_REPO / ".cache" / "artifacts"
    # the GPU test's k = 4: the target's speculative build (a verify program of 5 rows only under
    # INFC_VERIFY_PROGRAM=1, here and on the GPU machine: infc/config.py narrow_tokens_for)
    n = narrow_tokens_for(SimpleNamespace(num_speculative_tokens=4))
    _both_tunings(f"qwen3-4b with the hidden states of layers {list(layers)}, k = 4",
                  arts / ("qwen3-4b" + artifact_tag(narrow=n, capture=layers)), model_dir=str(target),
                  capture=list(layers), narrow_tokens=n, check_checkpoint=False)
    # the head's page size: each table's default, as the target's (backend: the target's own)
    _both_tunings(f"{EAGLE3_HEAD} (an EAGLE-3 head for qwen3-4b)", arts / (EAGLE3_HEAD + "-eagle3"),
                  model_dir=str(head), spec_path=str(SPECS_DIR / "eagle3.yaml"), check_checkpoint=False)


MTP_CUT = "deepseek-v3-l5-mtp"   # tests/gpu/test_spec_mtp_gpu.py's MTP_CUT
MTP_K = 3                        # and its MTP_K


def mtp():
    """deepseek-v3-l5 (gpu_families) with num_nextn_predict_layers 1, config-only, and the builds
    `LLM(..., device="cuda", load_format="dummy")` makes of it, plain and with --speculative-config
    method mtp (k = MTP_K): the target with the hidden state after its last layer as an output
    (infc/backend.py mtp_layers, artifact_tag) and the MTP layer (compile_model section "mtp",
    infc/backend.py cuda_mtp_artifact). The kernel cache compiles the shared kernels once."""
    from types import SimpleNamespace
    from infc.backend import SERVED_ARTIFACTS, mtp_artifact_dir
    from infc.config import artifact_tag, narrow_tokens_for
    sys.path.insert(0, str(REPO / "tests" / "gpu"))
    import gpu_families
    d = gpu_families.write_config("deepseek-v3-l5", out=GPU_CACHE / "configs" / MTP_CUT, num_nextn_predict_layers=1)
    L = json.loads((d / "config.json").read_text())["num_hidden_layers"]
    # 1 (no verify program) unless INFC_VERIFY_PROGRAM=1 here and on the GPU machine
    n = narrow_tokens_for(SimpleNamespace(num_speculative_tokens=MTP_K))
    _both_tunings(f"{MTP_CUT} (plain)", SERVED_ARTIFACTS / MTP_CUT, model_dir=str(d), check_checkpoint=False)
    _both_tunings(f"{MTP_CUT} with the hidden state after layer {L}, k = {MTP_K}",
                  SERVED_ARTIFACTS / (MTP_CUT + artifact_tag(narrow=n, capture=[L])), model_dir=str(d),
                  capture=[L], narrow_tokens=n, check_checkpoint=False)
    _both_tunings(f"{MTP_CUT}'s MTP layer", mtp_artifact_dir(MTP_CUT), model_dir=str(d), section="mtp",
                  check_checkpoint=False)


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
    # the same plan where `infc serve` / `bench prefix` on its config directory look for it
    # (infc/backend.py: .cache/artifacts/<the directory's name>): session.sh qwen35-prefix
    from infc.compiler.build import REPO as BUILD_REPO
    _both_tunings("qwen3.5-4b (served: bench prefix)", BUILD_REPO / ".cache" / "artifacts" / d.name,
                  model_dir=str(d))
    served_config("qwen3-4b")                           # its artifact: base's .cache/artifacts/qwen3-4b


DEEPSEEK = {"deepseek-v2-lite-l8": "8 layers, golden gate",                 # gpu_families.FAMILIES
            "deepseek-v2-lite": "27 layers, latency with dummy weights"}   # gpu_families.LATENCY


def gptoss():
    """gpt-oss-20b at full depth with its MXFP4 experts (gpu_families.LATENCY): config and artifact
    for bench latency with dummy weights (--model-path .cache/gpu/configs/gpt-oss-20b)."""
    sys.path.insert(0, str(REPO / "tests" / "gpu"))
    import gpu_families
    d = gpu_families.write_config("gpt-oss-20b")
    _both_tunings("gpt-oss-20b (24 layers, MXFP4 experts, latency with dummy weights)",
                  gpu_families.artifact_dir("gpt-oss-20b"), model_dir=str(d))
    # the same commit with compiler/passes/upcast_experts.py off (infc/config.py UPCAST_EXPERTS, on
    # by default): session.sh gptoss's A/B of the pass (GPTOSS_ARTS)
    _both_tunings("gpt-oss-20b, experts never upcast (the A/B's other side)",
                  GPU_CACHE / "gpt-oss-20b-noup-art", model_dir=str(d), config={"UPCAST_EXPERTS": False})
    # the experts' bf16 stacks made once by the load program and kept (infc/config.py
    # RESIDENT_EXPERT_STACKS_MAX_BYTES, 0 = off by default; GPT-OSS-20B's are 35.6 GiB): the A/B's
    # third side (GPTOSS_ARTS=".cache/gpu/gpt-oss-20b-art .cache/gpu/gpt-oss-20b-resident-art")
    _both_tunings("gpt-oss-20b, experts' bf16 stacks resident (the load program)",
                  GPU_CACHE / "gpt-oss-20b-resident-art", model_dir=str(d),
                  config={"RESIDENT_EXPERT_STACKS_MAX_BYTES": 48 << 30})


def dsv4():
    """DeepSeek-V4-Flash's 3-layer cut at real widths (gpu_families.DSV4_CUT): its config.json as
    transformers 5.23 writes it into .cache/gpu/configs/<cut>/ and the artifact into
    .cache/gpu/<cut>-art, for session.sh's `dsv4` stage: the golden gate (the GPU machine makes the
    random HF model from the same config) and bench latency of the same artifact with dummy weights
    (--model-path .cache/gpu/configs/<cut>)."""
    sys.path.insert(0, str(REPO / "tests" / "gpu"))
    import gpu_families
    name = gpu_families.DSV4_CUT
    d = gpu_families.write_config(name)
    _both_tunings(f"{name} (3 layers at real widths: golden gate, latency with dummy weights)",
                  gpu_families.artifact_dir(name), model_dir=str(d), tuning_overlay=DSV4_TUNE)


# The sliding layer's attention at Hq 64 on one K/V head of D 512: the tables' defaults need more
# shared memory than sm_90 has (attention_decode 327,680 B of 232,448) or compile for over 17
# minutes (attention_mixed's short-phase split role, 16 x 64 rows of 512); one stage and one-row
# split programs fit (196,608-196,616 B: bench/NOTES.md, "Issue 47: the GPU acceptance prepared").
# Laid over this build alone until the tables hold entries for these shapes.
DSV4_TUNE = {"attention_decode": {"default": {"num_stages": 1}},
             "attention_prefill": {"default": {"num_stages": 1}},
             "attention_mixed": {"default": {"QMAX": 1, "num_stages": 1}}}


def deepseek():
    sys.path.insert(0, str(REPO / "tests" / "gpu"))
    import gpu_families
    for name, what in DEEPSEEK.items():
        d = gpu_families.write_config(name)
        _both_tunings(f"{name} ({what})", gpu_families.artifact_dir(name), model_dir=str(d))


TINY_QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 256,
              "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8,
              "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 4096,
              "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
              "tie_word_embeddings": True, "hidden_act": "silu", "attention_bias": False,
              "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}
RANKS = GPU_CACHE / "ranks"
# (model, tag) -> the settings of compiler/parallel.py; "whole" is the single-GPU plan, "tp1" / "ep1"
# one-rank plans with the collectives in (one_rank_plan)
def _moe_l4() -> dict:
    """qwen3-30b-a3b cut to 4 layers at its real shapes (128 experts, top-8, 768-wide experts)."""
    from prepare_moe import config
    cfg = config()
    cfg.update(num_hidden_layers=4, max_window_layers=4, torch_dtype="bfloat16")
    return cfg


RANK_CONFIGS = {"tiny-qwen3": TINY_QWEN3, "tiny-moe": TINY_MOE, "qwen3-30b-a3b-l4": _moe_l4()}
RANK_BUILDS = {("tiny-qwen3", "whole"): None, ("tiny-qwen3", "tp2"): dict(tensor_parallel_size=2),
               ("tiny-moe", "whole"): None, ("tiny-moe", "tp2"): dict(tensor_parallel_size=2),
               ("tiny-moe", "tp2ep2"): dict(tensor_parallel_size=2, enable_expert_parallel=True),
               ("tiny-moe", "ep2"): dict(expert_parallel_only=2),
               ("tiny-moe", "tp1"): "tp", ("tiny-moe", "ep1"): "ep",
               ("qwen3-30b-a3b-l4", "whole"): None, ("qwen3-30b-a3b-l4", "tp2"): dict(tensor_parallel_size=2),
               ("qwen3-30b-a3b-l4", "ep2"): dict(expert_parallel_only=2),
               # attention data-parallel with EP (issue 14): each rank its own sequences
               ("tiny-moe", "dp2"): dict(data_parallel_size=2, enable_expert_parallel=True),
               ("qwen3-30b-a3b-l4", "dp2"): dict(data_parallel_size=2, enable_expert_parallel=True)}


def ranks_config(name: str) -> Path:
    return RANKS / "configs" / name


def ranks_artifact(name: str, tag: str) -> Path:
    return RANKS / f"{name}-{tag}"


def one_rank_plan(model_dir: Path, out: Path, mode: str, gpu: str = "h100", target: str = "sm_90"):
    """A world-1 plan that still has its collectives, as a rank of an N-rank build would: the
    tensor-parallel transform ("tp": an all_reduce after every row-parallel linear and after the
    experts) or the expert-parallel one ("ep": ep_dispatch / ep_combine around the experts) applied
    at world 1, where shard_ranks itself leaves the graph alone. Its collectives are identities, so
    the one-rank NCCL path must give the whole plan's logits."""
    from infc.compiler.build import compile_model, generate
    from infc.compiler.codegen.aot import compile_kernels
    from infc.compiler.codegen.rank_kernels import attach_rank_kernels
    from infc.compiler.passes import shard_ranks as sr
    from infc.compiler.plan import dumps
    from infc.compiler.contract.program import unrolled

    def observe(name, state):            # after split_attention, where shard_ranks would run
        if name == "split_attention":
            for g in state.graph.walk():
                (sr._tensor_parallel if mode == "tp" else sr._expert_parallel)(state, g, 0, 1)

    state, plan = compile_model(model_dir=str(model_dir), observe=observe,
                                parallel={"world": 1, "rank": 0, "tp": 1, "ep": 1})
    ops = {l["op"] for l, _ in unrolled(plan["programs"]["decode"])}
    want = {"all_reduce"} if mode == "tp" else {"ep_dispatch", "ep_combine"}
    assert want <= ops, f"one-rank {mode} plan without {want - ops}"
    out.mkdir(parents=True, exist_ok=True)
    kernels = generate(plan, out, gpu, 16, target, spec_path=state.spec.path)
    kernels.update(attach_rank_kernels(plan, out))
    (out / "plan.json").write_text(dumps(plan))
    compile_kernels(kernels, out / "bin", target, progress=False)


def ranks():
    import shutil
    import time
    from infc.compiler.build import build
    from infc.compiler.build import build_ranks
    from infc.compiler.parallel import settings
    for name in RANK_CONFIGS:
        _ranks_config_written(name)
    for (name, tag), how in RANK_BUILDS.items():
        t0, out, d = time.time(), ranks_artifact(name, tag), ranks_config(name)
        shutil.rmtree(out, ignore_errors=True)
        if how is None:
            build(model_dir=str(d), out=out, log=None)
        elif isinstance(how, str):
            one_rank_plan(d, out, how)
        else:
            build_ranks(settings(**how), model_dir=str(d), out=out, log=None)
        print(f"[prepare] ranks {name} {tag}: {time.time() - t0:.1f} s, {_size(out)} -> {out}", flush=True)


# issue 14: artifact name (.cache/artifacts/<name>: what load_backend builds for a model directory
# of that base name on the GPU machine) -> (config directory maker, tensor_parallel_size,
# enable_expert_parallel[, data_parallel_size]). The golden gates' directories: /tmp/infc-models/qwen3-4b (models.py),
# ranks-qwen3-30b-a3b-l4 (test_ranks_gpu.py), deepseek-v2-lite-l8 (gpu_families); the benchmarks'
# config-only ones (--load-format dummy): .cache/gpu/configs/qwen3-30b-a3b and deepseek-v2-lite.
def _moe_full() -> Path:
    from prepare_moe import write_config
    return write_config("qwen3-30b-a3b")


def _family_config(name: str) -> Path:
    sys.path.insert(0, str(REPO / "tests" / "gpu"))
    import gpu_families
    return gpu_families.write_config(name)


TWOGPU = {
    "qwen3-4b": (lambda: served_config("qwen3-4b"), 1, False),
    "qwen3-4b-tp2": (lambda: served_config("qwen3-4b"), 2, False),
    "ranks-qwen3-30b-a3b-l4-tp2-ep2": (lambda: _ranks_config_written("qwen3-30b-a3b-l4"), 2, True),
    "deepseek-v2-lite-l8-tp2-ep2": (lambda: _family_config("deepseek-v2-lite-l8"), 2, True),
    "qwen3-30b-a3b": (_moe_full, 1, False),
    "qwen3-30b-a3b-tp2-ep2": (_moe_full, 2, True),
    "deepseek-v2-lite": (lambda: _family_config("deepseek-v2-lite"), 1, False),
    "deepseek-v2-lite-tp2-ep2": (lambda: _family_config("deepseek-v2-lite"), 2, True),
    # attention data-parallel + EP: (config, tp, ep, dp)
    "ranks-qwen3-30b-a3b-l4-dp2-ep2": (lambda: _ranks_config_written("qwen3-30b-a3b-l4"), 1, True, 2),
    "qwen3-30b-a3b-dp2-ep2": (_moe_full, 1, True, 2),
}


def twogpu_artifact(name: str) -> Path:
    from infc.compiler.build import REPO as BUILD_REPO
    return BUILD_REPO / ".cache" / "artifacts" / name


def _ranks_config_written(name: str) -> Path:
    d = ranks_config(name)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(RANK_CONFIGS[name], indent=1))
    return d


def twogpu():
    for name, (config, tp, ep, *dp) in TWOGPU.items():
        extra = {"data_parallel_size": dp[0]} if dp else {}
        _both_tunings(f"twogpu {name}", twogpu_artifact(name), model_dir=str(config()),
                      tensor_parallel_size=tp, enable_expert_parallel=ep, **extra)
    qwen_tokenizer()


def qwen_tokenizer():
    """The Qwen tokenizer's files in .cache/gpu/qwen-tokenizer (the parts whose servers get text),
    written once."""
    from make_random_model import write_tokenizer
    if not (GPU_CACHE / "qwen-tokenizer" / "tokenizer.json").exists():
        write_tokenizer("qwen3", GPU_CACHE / "qwen-tokenizer", "qwen")


def server():
    """The SDK suite's model directories of the new families (gpu_families.SERVER): config.json
    into .cache/gpu/configs/<dir>, the artifact `infc serve` reuses into .cache/artifacts/<dir>."""
    from infc.compiler.build import REPO as BUILD_REPO
    sys.path.insert(0, str(REPO / "tests" / "gpu"))
    import gpu_families
    for name, extra in gpu_families.SERVER.items():
        dir_name = gpu_families.server_dir_name(name)
        d = gpu_families.write_config(name, GPU_CACHE / "configs" / dir_name, **extra)
        _both_tunings(f"{dir_name} (the SDK suite)", BUILD_REPO / ".cache" / "artifacts" / dir_name,
                      model_dir=str(d))
    qwen_tokenizer()


def skipgram_config() -> Path:
    """The tiny trained Llama's config-only directory (.cache/gpu/skipgram): it is trained on the
    GPU machine (tests/gpu/trained_model.py), its artifacts built here from this config.json."""
    sys.path.insert(0, str(REPO / "tests" / "gpu"))
    from trained_model import config_json
    cfg_dir = GPU_CACHE / "skipgram"
    cfg_dir.mkdir(parents=True, exist_ok=True)
    (cfg_dir / "config.json").write_text(json.dumps(config_json(), indent=1))
    return cfg_dir


def base():
    from infc.compiler.build import REPO as BUILD_REPO, build
    from make_random_model import write_tokenizer
    cfg_dir = GPU_CACHE / "tiny-moe"
    cfg_dir.mkdir(parents=True, exist_ok=True)
    (cfg_dir / "config.json").write_text(json.dumps(TINY_MOE, indent=1))
    build(model_dir=str(cfg_dir), out=GPU_CACHE / "tiny-moe-art")
    cfg_dir = skipgram_config()
    build(model_dir=str(cfg_dir), out=GPU_CACHE / "skipgram-art")
    _both_tunings("skipgram (LLM(device=\"cuda\") on it)", BUILD_REPO / ".cache" / "artifacts" / "skipgram",
                  model_dir=str(cfg_dir))
    for name in SERVED:
        _both_tunings(f"{name} (served)", BUILD_REPO / ".cache" / "artifacts" / name,
                      model_dir=str(served_config(name)))
    write_tokenizer("qwen3", GPU_CACHE / "qwen-tokenizer", "qwen")


if __name__ == "__main__":
    main(sys.argv[1:] or DEFAULT_PARTS)
