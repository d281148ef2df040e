#!/usr/bin/env bash
# One GPU session in one call, stage by stage, each bounded by its own timeout:
#   bash tests/gpu/run.sh OUT_DIR suite latency throughput     (the entry point; or, as it runs this:
#   STAGES="suite latency throughput" tests/gpu/session.sh OUT_DIR)
# Stages: suite (tests/gpu: golden gate of every model incl. qwen3-4b --no-fuse and the new
# families, engine, no torch), families (only the new families' golden gate), baseline (a
# baseline commit's qwen3-4b latency on the same card: tools/prepare_baseline.sh), latency,
# profile (per-launch GPU times of a short prefill, a prefix hit, a 256-sequence mixed step and
# batch-1 decode: bench/profile.py; PROFILE_ARTIFACT another qwen3-4b artifact), profile-moe (the same for qwen3-30b-a3b with dummy weights:
# batch-1 decode, 255 decodes alone and beside a 2-token chunk, the mixed step), throughput, startup, server (the SDK suite with --device
# cuda), serve (infc bench serve against infc serve), prefix (TTFT cold vs warm prefix hit at
# 1k-32k tokens, in-process engine and through a spawned infc serve: bench/prefix.py; PREFIX_ARGS
# adds flags, e.g. --load-format dummy), generate (infc generate --device cuda), tune (infc tune run),
# qwen35 (batch-1 TPOT / TTFT at 32, 1k, 8k of the full 32-layer Qwen3.5-4B with dummy weights,
# floor = weights + KV + state bytes, then qwen3-4b the same way on the same card: prepare.py
# qwen35 (and base for qwen3-4b's artifact); QWEN35_ARGS adds flags to both), ranks (TP=2 / EP=2
# plans of a tiny qwen3 and a tiny qwen3_moe with every rank on this GPU and the collectives done
# by device copies, against the whole plan; the one-rank NCCL path: tests/gpu/test_ranks_gpu.py,
# after prepare.py ranks; it makes its own tiny model directories), deepseek (issue 13: batch-1 TPOT /
# TTFT at 32 and 1k of the full 27-layer DeepSeek-V2-Lite with dummy weights, then
# bench/active_floor.py on that run: the floor of the bytes a step reads (embedding row, attention,
# dense layer 0, router + shared + top-6 routed experts, lm_head, latent KV) over the copy bandwidth
# measured in the run, and the latent KV bytes per token beside a non-latent layout's: prepare.py
# deepseek; DEEPSEEK_ARGS adds flags to bench latency; its golden gate is the families stage with
# INFC_GPU_FAMILIES=deepseek-v2-lite-l8); moe the same for the full 48-layer qwen3-30b-a3b (issue 11:
# prepare.py twogpu builds .cache/artifacts/qwen3-30b-a3b).
# dsv4 (issue 47, after prepare.py dsv4 and tools/gpu_wheels.sh transformers==5.23.0
# huggingface-hub==1.33.0: DeepSeek-V4-Flash's 3-layer cut at real widths, one layer of each
# attention type and MLP type: the caches' bytes per token against an uncompressed layout, its
# golden gate against HF bf16, batch-1 TPOT / TTFT at 1k and 32k with dummy weights against the
# active floor, then its decode step per launch; see the stage).
# hardening (issue 39: tests/test_step_failure.py and tests/test_server_shutdown.py through infc
# serve --device cuda: a top_k request, an injected step failure, SIGTERM with 50 streams in flight).
# structured (issue 41: bench structured: batch-1 and 64-concurrent TPOT of qwen3-4b with every
# request under a JSON schema against the same run without, alternating rounds, and a new schema's
# compile / first-token cost; then the logits-processing and prompt-logprob GPU tests).
# server-families (the openai SDK suite over the Qwen3.5 and DeepSeek-V2-Lite cuts, after prepare.py
# server; SERVER_FAMILIES picks them).
# quant (issue 42, after prepare.py base quant: each models.QUANTIZED model (QUANT_MODELS picks)
# written here from the random bf16 qwen3-4b by tools/quantize_model.py (timed), then, where
# prepare.py could build its kernels, its golden gate against HF on the same checkpoint
# (test_golden.py -m quant), bench latency and throughput, and bench quant-accuracy (mean KL and
# top-1 agreement against the bf16 model's logits, and HF's same figures for the same checkpoint:
# tests/gpu/hf_quant_accuracy.py), into OUT/quant/<model>/, and the bf16 model's
# latency beside them; then the whole qwen3-30b-a3b FP8 (prepare.py QUANT_DUMMY, dummy weights)
# beside its bf16 build: bench latency and a per-launch profile (QUANT_SKIP="golden throughput
# accuracy dummy bf16" leaves steps out;
# QUANT_LATENCY_ARGS, QUANT_THROUGHPUT_ARGS add flags).
# tier-throughput (issue 44: 1024/128 throughput at 256 concurrent, host KV tier off and on, alternating).
# tier-prefix (issue 44: qwen3-4b (dummy weights) HBM prefix hits at TIER_PREFIX_LENGTHS (16k, 32k)
# with the host tier off and on (saving the cold prompts' blocks while the hits run), alternating
# TIER_RUNS (default 2) times, then the hit restored from the host tier with its copies' time).
# lora (issue 46, after prepare.py base lora: the multi-LoRA golden gate against HF + PEFT, then
# bench throughput of the base model beside 8 rank-16 adapters taken in turn; see the stage).
# qwen35-prefix (issue 44, after prepare.py qwen35: Qwen3.5-4B warm prefix hits at 1k / 16k
# against its cold prefill, engine and infc serve, dummy weights).
# lora-profile (issue 46, after prepare.py base lora: bench profile per launch of the base model and
# of the LoRA build with random adapters in its 8 slots; LORA_PROFILE_ARTS, LORA_PROFILE_ARGS).
# lora-tune (issue 46, after tools/experiments/lora_gemv_probe.py prepare: `infc tune run` of the
# base qwen3-4b's narrow GEMVs and of the LoRA build's four sites over the shrink's schedule grid,
# then the probe's report, per launch, into OUT/lora-tune.txt; TUNE_ARGS=--any-gpu times them on an H100).
# kv-fp8 (issue 42, after prepare.py base kvfp8: batch-1 TPOT at 1k and 32k of context with
# --kv-cache-dtype fp8 beside the bf16 KV cache, same model; KV_FP8_PROMPTS sets the prompts).
# overlap-ab (overlapped engine steps against INFC_OVERLAP=0, alternating: latency and throughput);
# ab the same for the switch AB_ENV names (INFC_WIDE: wide decode steps).
# twogpu, twogpu-server, twogpu-bench (issue 14, two GPUs, one process each over NCCL, after
# prepare.py twogpu): twogpu records the interconnect (nvidia-smi topo -m, NCCL's version) and runs
# tests/gpu/test_two_gpus.py (golden gates of qwen3-4b TP=2 and the qwen3-30b-a3b / DeepSeek-V2-Lite
# cuts with TP=2 + EP, a rank killed mid-stream); twogpu-server the openai SDK suite through a
# server over the rank processes (qwen3-4b TP=2, the qwen3-30b-a3b cut TP=2 + EP) and `infc serve`
# exiting when a rank is killed; twogpu-bench batch-1 TPOT / TTFT (bench latency) and 1024/128
# throughput at TWOGPU_CONCURRENCY (default 256) of qwen3-4b (TP=2), qwen3-30b-a3b (48 layers,
# TP=2 + EP) and DeepSeek-V2-Lite (27 layers, TP=2 + EP), each beside one GPU of the same machine,
# dummy weights (TWOGPU_BENCH picks some of: latency throughput moe-latency moe-throughput deepseek;
# TWOGPU_SKIP_ONE=1 runs only the two-rank side, TWOGPU_ONLY_ONE=1 only the one-GPU side; TWOGPU_NCCL_ONLY=1 runs the two ranks again with
# INFC_P2P=0, NCCL for every collective, into bench/nccl-only; TWOGPU_RANK_SYNC=1 runs them again
# with synchronous steps (INFC_RANK_OVERLAP=0; overlapped is the default) into bench/rank-sync; TWOGPU_DP=1 adds the
# attention data-parallel ranks with EP into bench/dp (TWOGPU_ONLY_DP=1: only those); TWOGPU_SERVER_RUNS="dir:TP:EP[:DP] ..."
# the server runs); twogpu-allreduce one all-reduce's time, NCCL against peer_sum, over message sizes
# (bench/allreduce.py); twogpu-nccl-env the same over NCCL settings (NCCL_ENVS). p2p: peer_sum, the one-shot all-reduce, with two ranks on this one GPU
# (tests/gpu/test_peer_sum_gpu.py, after prepare.py ranks).
# INFC_GPU_FAMILIES=a,b|all|none picks the families (default: gpu_families.DEFAULT; prepare.py must
# have built the same ones).
# Needs what tests/gpu/prepare.py built here (carry .cache/gpu, .cache/artifacts, .cache/tune)
# and, for packages the GPU machine lacks, wheels in .whl/. Logs and results land in OUT_DIR.
set -uo pipefail
OUT=${1:-${OUT:-/tmp/infc-gpu-out}}
mkdir -p "$OUT"
cd "$(dirname "$0")/../.."
# the commit: INFC_COMMIT, else the stamp prepare.py left beside the carried configs
stamp=$(cat .cache/gpu/configs/COMMIT 2>/dev/null)
if [ -n "${INFC_COMMIT:-}" ] && [ -n "$stamp" ] && [ "${stamp%-dirty}" != "$INFC_COMMIT" ]; then
  echo "WARNING: INFC_COMMIT=$INFC_COMMIT but the carried artifacts were prepared at $stamp" | tee -a "$OUT/session.log"
fi
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1 INFC_COMMIT=${INFC_COMMIT:-${stamp:-unknown}}
export NCCL_NVLS_ENABLE=0           # NVLink multicast stays off on these machines (device README)
MODELS=${INFC_GPU_MODELS:-/tmp/infc-models}
STAGES=${STAGES:-suite latency throughput startup server serve}
t0=$(date +%s)
say() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a "$OUT/session.log"; }
quiet() { grep --line-buffered -vE "Loading weights|it/s\]|^\s*$"; }

if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >"$OUT/wheels.log" 2>&1
  export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv | tee "$OUT/gpu.txt"
if [ -n "$(echo " $STAGES " | sed -e 's/ families / /g' -e 's/ qwen35 / /g' -e 's/ ranks / /g' -e 's/ p2p / /g' -e 's/ deepseek / /g' -e 's/ dsv4 / /g' -e 's/ gptoss / /g' -e 's/ cut-latency / /g' -e 's/ tier-probe / /g' -e 's/ tier-throughput / /g' -e "s/ moe / /g" -e 's/ profile-moe / /g' -e 's/ server-families / /g' -e 's/ twogpu[a-z-]* / /g' -e 's/ twogpu[a-z-]* / /g' | tr -d ' ')" ]; then   # a stage besides families / qwen35 / ranks / deepseek / dsv4 / profile-moe / server-families / twogpu*
  say "models"
  timeout 300 python3 -c "import sys; sys.path.insert(0,'tests/gpu'); import models; [models.model_dir(m) for m in ('qwen3-4b','llama-3.2-1b','tiny-moe','skipgram')]" 2>&1 | tail -12
  say "models ready"
  # prepare.py leaves .cache/artifacts/qwen3-4b rendered with the last table it built (h200); the
  # stages that time that plan directly (latency, profile) must run this GPU's table, as
  # LLM(device="cuda") does. Both tables' cubins are there: this compiles nothing.
  python3 tests/gpu/rerender.py .cache/artifacts/qwen3-4b 2>&1 | tail -2
fi
# the families' models are made inside pytest, one at a time, and deleted after their tests

for stage in $STAGES; do
  say "stage $stage"
  case $stage in
    suite)
      timeout ${SUITE_S:-510} python3 -m pytest ${SUITE_PATHS:-tests/gpu} -q -s -p no:cacheprovider ${PYTEST_ARGS:-} 2>&1 | quiet \
        | tee "$OUT/pytest-gpu.log" | grep -E "passed|failed|error|regret|KV exhaustion|made and saved|^E " | tail -80 ;;
    families)
      timeout ${FAMILIES_S:-420} python3 -m pytest tests/gpu/test_golden.py -m families -q -s -p no:cacheprovider \
        ${PYTEST_ARGS:-} 2>&1 | quiet | tee "$OUT/pytest-families.log" \
        | grep -E "passed|failed|error|regret|made and saved|setup:|^E " | tail -60 ;;
    baseline)
      # the baseline commit's qwen3-4b (tools/prepare_baseline.sh COMMIT built it here), timed on
      # this card with the baseline's own code, beside the tree's `latency` stage. Its package
      # is laid out as infc.{compiler,runtime,...} by links, first on the path (the tree's
      # editable install is a meta-path finder, consulted after the path).
      shim=/tmp/infc-baseline-shim; rm -rf $shim; mkdir -p $shim
      cp -r .cache/baseline/infc $shim/infc
      for d in compiler runtime server bench; do ln -s "$PWD/.cache/baseline/$d" $shim/infc/$d; done
      mkdir -p "$OUT/baseline"
      (cd $shim && INFC_COMMIT=$(cat "$OLDPWD/.cache/baseline-art/commit" 2>/dev/null || echo baseline) PYTHONPATH=$shim:${PYTHONPATH:-} timeout ${BASELINE_S:-150} python3 -m infc.cli \
        bench latency --artifact "$OLDPWD/.cache/baseline-art/qwen3-4b" --model-path "$MODELS/qwen3-4b" \
        --no-hf --out "$OUT/baseline") 2>&1 | quiet | tail -6 ;;
    latency)
      timeout ${LATENCY_S:-240} python3 -m infc.cli bench latency --artifact .cache/artifacts/qwen3-4b \
        --model-path "$MODELS/qwen3-4b" --out "$OUT" ${LATENCY_ARGS:-} 2>&1 | quiet | tail -12 ;;
    profile)
      timeout ${PROFILE_S:-150} python3 -m infc.cli bench profile --artifact ${PROFILE_ARTIFACT:-.cache/artifacts/qwen3-4b} \
        --model-path "$MODELS/qwen3-4b" --out "$OUT" ${PROFILE_ARGS:-} 2>&1 | quiet | tail -150 ;;
    profile-moe)
      python3 tests/gpu/rerender.py .cache/artifacts/qwen3-30b-a3b 2>&1 | tail -2
      timeout ${PROFILE_S:-240} python3 -m infc.cli bench profile --artifact .cache/artifacts/qwen3-30b-a3b \
        --model-path .cache/gpu/configs/qwen3-30b-a3b --load-format dummy --out "$OUT" \
        --steps ${PROFILE_STEPS:-decode_b1,decode_wide,decode_wide_mixed,mixed_256} --reps 10 \
        ${PROFILE_ARGS:-} 2>&1 | quiet | tail -150 ;;
    throughput)
      timeout ${THROUGHPUT_S:-240} python3 -m infc.cli bench throughput --model-path "$MODELS/qwen3-4b" \
        --out "$OUT" 2>&1 | quiet | tail -12 ;;
    startup)
      timeout ${STARTUP_S:-150} python3 -m infc.cli bench startup --model-path "$MODELS/qwen3-4b" \
        --out "$OUT" 2>&1 | quiet | tail -8 ;;
    startup-overlap)
      # issue 49 item 6: `bench startup` with the checkpoint streamed beside the caches and the
      # graph capture (INFC_LOAD_OVERLAP=1) against the default, alternating STARTUP_OVERLAP_RUNS
      # (default 2) times, then the golden gate with it on (graphs captured over loading weights)
      for run in $(seq ${STARTUP_OVERLAP_RUNS:-2}); do
        for v in 0 1; do
          say "startup-overlap: INFC_LOAD_OVERLAP=$v (run $run)"
          mkdir -p "$OUT/startup-overlap/$v-run$run"
          INFC_LOAD_OVERLAP=$v timeout ${STARTUP_S:-150} python3 -m infc.cli bench startup --model-path "$MODELS/qwen3-4b" \
            --out "$OUT/startup-overlap/$v-run$run" 2>&1 | quiet | tail -2
        done
      done
      INFC_LOAD_OVERLAP=1 INFC_GPU_FAMILIES=none timeout ${SUITE_S:-300} python3 -m pytest tests/gpu/test_golden.py -q -s \
        -p no:cacheprovider 2>&1 | quiet | tee "$OUT/pytest-golden-overlap.log" | grep -E "passed|failed|error|^E " | tail -20 ;;
    server)
      INFC_SERVER_MODEL="$MODELS/qwen3-4b" INFC_SERVER_DEVICE=cuda timeout ${SERVER_S:-240} python3 -m pytest \
        tests/test_server.py tests/test_server_disconnect.py tests/test_server_fuzz.py -q -p no:cacheprovider \
        -o addopts="" 2>&1 | tee "$OUT/pytest-server-cuda.log" | tail -15 ;;
    hardening)
      # issue 39 on the GPU: infc serve --device cuda keeps serving after a top_k at the int32 edge
      # and an injected step failure (INFC_FAULT_INJECT), and SIGTERM with 50 streams in flight
      # (46 long, 4 short) exits 0 within --shutdown-timeout: tests/test_step_failure.py and
      # tests/test_server_shutdown.py on this card
      INFC_SERVER_MODEL="$MODELS/qwen3-4b" INFC_SERVER_DEVICE=cuda timeout ${HARDENING_S:-300} python3 -m pytest \
        tests/test_step_failure.py tests/test_server_shutdown.py -k "server or drains or second or idle or stalled" \
        -q -p no:cacheprovider -o addopts="" -rA 2>&1 | tee "$OUT/pytest-hardening-cuda.log" | tail -25 ;;
    structured)
      timeout ${STRUCTURED_S:-300} python3 -m infc.cli bench structured --artifact .cache/artifacts/qwen3-4b \
        --model-path "$MODELS/qwen3-4b" --out "$OUT" ${STRUCTURED_ARGS:-} 2>&1 | quiet | tail -8
      timeout ${STRUCTURED_TESTS_S:-240} python3 -m pytest ${STRUCTURED_TESTS:-tests/gpu/test_logits_process_gpu.py} \
        -q -s -p no:cacheprovider -rA 2>&1 | quiet | tee "$OUT/pytest-structured-gpu.log" | tail -15 ;;
    serve)
      python3 -m infc.cli serve --model-path "$MODELS/qwen3-4b" --device cuda --port 8011 \
        --disable-uvicorn-access-log >"$OUT/serve.log" 2>&1 &
      pid=$!
      python3 -c "
import time, urllib.request
for _ in range(600):
    try:
        urllib.request.urlopen('http://127.0.0.1:8011/health', timeout=1); break
    except OSError:
        time.sleep(0.1)"
      timeout ${SERVE_S:-200} python3 -m infc.cli bench serve --base-url http://127.0.0.1:8011 \
        --num-prompts ${SERVE_PROMPTS:-32} --out "$OUT" 2>&1 | tail -12
      kill $pid; wait $pid 2>/dev/null ;;
    prefix)
      timeout ${PREFIX_S:-480} python3 -m infc.cli bench prefix --model-path "$MODELS/qwen3-4b" \
        --out "$OUT" ${PREFIX_ARGS:-} 2>&1 | quiet | tail -24 ;;
    serve-trace)
      # issue 49 item 5: where the warm +16 hit's time goes inside `infc serve` (bench prefix
      # --trace-server: connection, routing, the worker pool's parse, the engine's step, the chunk;
      # medians after the client's send) beside the engine path, at SERVE_TRACE_LENGTHS
      mkdir -p "$OUT/serve-trace"
      timeout ${PREFIX_S:-240} python3 -m infc.cli bench prefix --model-path $MODELS/qwen3-4b --path both \
        --lengths ${SERVE_TRACE_LENGTHS:-1024,16384} --trace-server --out "$OUT/serve-trace" 2>&1 | quiet \
        | grep -E "L=|wrote|rror" ;;
    short-graphs)
      # issue 49 item 5: the warm +16 hit with its short step replayed from a CUDA Graph
      # (INFC_SHORT_GRAPHS=1) against eager launches, in the engine and through `infc serve`
      # (traced), alternating SHORT_GRAPHS_RUNS (default 2) times, then the golden gate (its prefix
      # replays run short steps) and the engine tests with it on (INFC_SHORT_GRAPHS_BY_CONTEXT=1 in
      # the environment: a graph a context range, the A/B of 1k hits' graphs replayed at 16k)
      for run in $(seq ${SHORT_GRAPHS_RUNS:-2}); do
        for v in 0 1; do
          say "short-graphs: INFC_SHORT_GRAPHS=$v (run $run)"
          mkdir -p "$OUT/short-graphs/$v-run$run"
          INFC_SHORT_GRAPHS=$v timeout ${PREFIX_S:-200} python3 -m infc.cli bench prefix --model-path $MODELS/qwen3-4b \
            --path both --lengths ${SHORT_GRAPHS_LENGTHS:-1024,16384} --trace-server --out "$OUT/short-graphs/$v-run$run" \
            2>&1 | quiet | grep -E "L=|rror"
        done
      done
      # the same hits in one process, eager and graph in turn (each process runs at its own speed
      # on the GPU machine): graphs keyed by (T, B), then by context range as well
      for by in 0 1; do
        say "short-graphs: one process, INFC_SHORT_GRAPHS alternating, INFC_SHORT_GRAPHS_BY_CONTEXT=$by"
        mkdir -p "$OUT/short-graphs/alternate-by-context$by"
        INFC_SHORT_GRAPHS_BY_CONTEXT=$by timeout ${PREFIX_S:-200} python3 -m infc.cli bench prefix \
          --model-path $MODELS/qwen3-4b --path engine --lengths ${SHORT_GRAPHS_LENGTHS:-1024,16384} \
          --reps ${SHORT_GRAPHS_REPS:-20} --alternate INFC_SHORT_GRAPHS --out "$OUT/short-graphs/alternate-by-context$by" \
          2>&1 | quiet | grep -E "L=|rror"
      done
      INFC_SHORT_GRAPHS=1 INFC_GPU_FAMILIES=none timeout ${SUITE_S:-300} python3 -m pytest tests/gpu/test_golden.py \
        tests/gpu/test_engine_gpu.py -q -s -p no:cacheprovider 2>&1 | quiet | tee "$OUT/pytest-short-graphs.log" \
        | grep -E "passed|failed|error|^E " | tail -20 ;;
    serve-gil)
      # issue 49 item 5: the warm +16 hit at 1k through `infc serve` (~8.8 ms) against the engine's
      # (~4.7): the GIL-convoy reading (bench/NOTES.md, "the start and the serving path") at the
      # default 5 ms switch interval, at 0.5 ms (a sitecustomize on PYTHONPATH, the server and the
      # client), and without overlapped steps (the engine thread runs no Python while the GPU runs)
      mkdir -p "$OUT/serve-gil" /tmp/infc-si && printf 'import sys\nsys.setswitchinterval(0.0005)\n' > /tmp/infc-si/sitecustomize.py
      p="python3 -m infc.cli bench prefix --model-path $MODELS/qwen3-4b --path serve --lengths ${SERVE_GIL_LENGTHS:-1024}"
      say "serve-gil: default switch interval"
      timeout ${PREFIX_S:-180} $p --out "$OUT/serve-gil/si5" 2>&1 | quiet | grep -E "L=|wrote|rror"
      say "serve-gil: 0.5 ms switch interval"
      PYTHONPATH=/tmp/infc-si${PYTHONPATH:+:$PYTHONPATH} timeout ${PREFIX_S:-180} $p --out "$OUT/serve-gil/si05" 2>&1 | quiet | grep -E "L=|wrote|rror"
      say "serve-gil: no overlapped steps"
      timeout ${PREFIX_S:-180} $p --out "$OUT/serve-gil/nooverlap" -- --disable-overlap-schedule 2>&1 | quiet | grep -E "L=|wrote|rror" ;;
    generate)
      timeout 120 python3 -m infc.cli generate --model-path "$MODELS/qwen3-4b" --device cuda \
        --prompt "The capital of France is" --prompt "def fib(n):" --max-tokens 12 2>&1 | tee "$OUT/generate.log" | tail -4 ;;
    qwen35)
      # config-only directories (no checkpoint, no tokenizer): weights filled on the device
      timeout ${QWEN35_S:-300} python3 -m infc.cli bench latency --artifact .cache/gpu/qwen3.5-4b-art \
        --model-path .cache/gpu/configs/qwen3.5-4b --load-format dummy --no-hf --out "$OUT" \
        ${QWEN35_ARGS:-} 2>&1 | quiet | tail -12
      if [ -d .cache/artifacts/qwen3-4b/bin ] && [ -f .cache/gpu/configs/qwen3-4b/config.json ]; then
        timeout ${QWEN35_S:-300} python3 -m infc.cli bench latency --artifact .cache/artifacts/qwen3-4b \
          --model-path .cache/gpu/configs/qwen3-4b --load-format dummy --no-hf --out "$OUT" \
          ${QWEN35_ARGS:-} 2>&1 | quiet | tail -12
      else
        say "qwen35: no qwen3-4b artifact or config here (prepare.py base qwen35): qwen3-4b not timed"
      fi ;;
    qwen35-prefix)
      # issue 44 (after prepare.py qwen35): Qwen3.5-4B (dummy weights) warm prefix hits at
      # QWEN35_PREFIX_LENGTHS against its cold prefill, engine and `infc serve` (the hybrid model's
      # state snapshots kept with the cached blocks); the startup lines report the snapshots' memory
      mkdir -p "$OUT/qwen35-prefix"
      timeout ${QWEN35_PREFIX_S:-420} python3 -m infc.cli bench prefix --model-path .cache/gpu/configs/qwen3.5-4b \
        --load-format dummy --lengths ${QWEN35_PREFIX_LENGTHS:-1024,16384} --reps ${QWEN35_PREFIX_REPS:-5} \
        --path both --out "$OUT/qwen35-prefix" 2>&1 | quiet \
        | tee "$OUT/qwen35-prefix/log.txt" | grep -iE "snapshot|ttft|cold|warm|rror|wrote" | tail -30 ;;
    ranks)
      timeout ${RANKS_S:-420} python3 -m pytest tests/gpu/test_ranks_gpu.py -q -s -p no:cacheprovider -rs \
        ${PYTEST_ARGS:-} 2>&1 | quiet | tee "$OUT/pytest-ranks.log" \
        | grep -E "passed|failed|error|skipped|SKIPPED|\[ranks\]|^E " | tail -60 ;;
    deepseek|moe)
      # config-only directory (no checkpoint, no tokenizer): weights filled on the device. The
      # artifact's plan.json is the H200 table's (prepare.py builds both tables' cubins): on another
      # card it is re-rendered with that card's table first, compiling nothing, as for qwen3-4b above.
      # deepseek: DeepSeek-V2-Lite, 27 layers (issue 13); moe: qwen3-30b-a3b, 48 layers (issue 11).
      # STAGE_ARTS: artifacts of the same model to run in turn instead (an A/B of builds:
      # tests/gpu/build_variants.py, e.g. a "_config" variant), each into $OUT/<stage>/<artifact>
      if [ "$stage" = deepseek ]; then art=.cache/gpu/deepseek-v2-lite-art cfg=.cache/gpu/configs/deepseek-v2-lite
      else art=.cache/artifacts/qwen3-30b-a3b cfg=.cache/gpu/configs/qwen3-30b-a3b; fi
      rm -rf "$OUT/$stage"; mkdir -p "$OUT/$stage"
      for art in ${STAGE_ARTS:-$art}; do
        o="$OUT/$stage"; [ -n "${STAGE_ARTS:-}" ] && o="$OUT/$stage/$(basename $art)" && mkdir -p "$o"
        python3 tests/gpu/rerender.py $art 2>&1 | tail -2
        timeout ${DEEPSEEK_S:-240} python3 -m infc.cli bench latency --artifact $art --model-path $cfg \
          --load-format dummy --no-hf --prompts 32,1024 --output-len 128 --out "$o" \
          ${DEEPSEEK_ARGS:-} 2>&1 | quiet | tail -12
        for f in "$o"/latency-*.json; do     # bench latency's result
          [ -f "$f" ] && python3 -m infc.bench.active_floor --artifact $art --latency "$f" --output-len 128 2>&1 | tail -8
        done
      done ;;
    dsv4)
      # issue 47, after prepare.py dsv4, with .whl/ holding transformers 5.23 (tools/gpu_wheels.sh;
      # the machine's 5.17 has no deepseek_v4): DeepSeek-V4-Flash's 3-layer cut at real widths
      # (gpu_families.DSV4_CUT): its caches' bytes per token against an uncompressed layout
      # (bench/cache_bytes.py, from the plan), its golden gate against HF bf16 (test_golden.py,
      # the families mechanism: HF makes the random model here), then batch-1 TPOT / TTFT at
      # DSV4_PROMPTS (1024,32768) with dummy weights against the active floor (bench/active_floor.py:
      # 6 of the routed experts, the window- and top-k-bounded cache reads), then the decode step
      # per launch (bench profile, DSV4_PROFILE_STEPS). DSV4_SKIP="golden", "latency" or "profile"
      # leaves a step out; DSV4_ARGS adds flags to bench latency
      name=deepseek-v4-flash-l3
      art=.cache/gpu/$name-art cfg=.cache/gpu/configs/$name
      rm -rf "$OUT/dsv4"; mkdir -p "$OUT/dsv4"
      python3 -c "import transformers; print('transformers', transformers.__version__)" 2>&1 | tee "$OUT/dsv4/versions.txt"
      python3 -m infc.bench.cache_bytes --artifact $art --json "$OUT/dsv4/cache-bytes.json" 2>&1 | tee "$OUT/dsv4/cache-bytes.txt"
      case " ${DSV4_SKIP:-} " in *" golden "*) ;; *)
        INFC_GPU_FAMILIES=$name timeout ${DSV4_GOLDEN_S:-420} python3 -m pytest tests/gpu/test_golden.py -m families \
          -q -s -p no:cacheprovider ${PYTEST_ARGS:-} 2>&1 | quiet | tee "$OUT/dsv4/pytest-golden.log" \
          | grep -E "passed|failed|error|regret|made and saved|^E " | tail -30 ;; esac
      case " ${DSV4_SKIP:-} " in *" latency "*) ;; *)
        python3 tests/gpu/rerender.py $art 2>&1 | tail -2
        # one run a prompt length, each under its own timeout: a 32k prefill goes through
        # compressed_attention's one program a sequence (bench/NOTES.md), so the 1k result is kept
        # if the 32k run does not finish
        for n in $(echo ${DSV4_PROMPTS:-1024,32768} | tr , ' '); do
          mkdir -p "$OUT/dsv4/p$n"
          say "dsv4: bench latency, prompt $n"
          timeout ${DSV4_LATENCY_S:-240} python3 -m infc.cli bench latency --artifact $art --model-path $cfg \
            --load-format dummy --no-hf --prompts $n --output-len 128 --out "$OUT/dsv4/p$n" \
            ${DSV4_ARGS:-} 2>&1 | quiet | tee "$OUT/dsv4/p$n/latency.log" | tail -6
          for f in "$OUT/dsv4/p$n"/latency-*.json; do     # bench latency's result
            [ -f "$f" ] && python3 -m infc.bench.active_floor --artifact $art --latency "$f" --output-len 128 2>&1 | tail -4
          done
        done ;; esac
      # where a batch-1 decode step's time goes, per launch (its TPOT was 7x the active floor:
      # bench/NOTES.md, "Measured at d0c624f7")
      case " ${DSV4_SKIP:-} " in *" profile "*) ;; *)
        timeout ${PROFILE_S:-150} python3 -m infc.cli bench profile --artifact $art --model-path $cfg \
          --load-format dummy --out "$OUT/dsv4" --steps ${DSV4_PROFILE_STEPS:-decode_b1} --reps 10 \
          2>&1 | quiet | tail -60 ;; esac ;;
    p2p)
      timeout ${P2P_S:-180} python3 -m pytest tests/gpu/test_peer_sum_gpu.py -q -s -p no:cacheprovider -rs \
        2>&1 | quiet | tee "$OUT/pytest-peer-sum.log" | grep -E "passed|failed|error|skipped|^E " | tail -30 ;;
    twogpu)
      nvidia-smi topo -m | tee "$OUT/topo.txt"
      python3 -c "from infc.runtime.cuda import nccl; print('NCCL', '.'.join(map(str, nccl.version())), nccl.library().path)" | tee -a "$OUT/topo.txt"
      python3 tests/gpu/rerender.py .cache/artifacts/*-tp2* .cache/artifacts/*-dp2* 2>&1 | tail -8
      timeout ${TWOGPU_S:-540} python3 -m pytest tests/gpu/test_two_gpus.py -q -s -p no:cacheprovider -rs \
        ${PYTEST_ARGS:-} 2>&1 | quiet | tee "$OUT/pytest-two-gpus.log" \
        | grep -E "passed|failed|error|skipped|\[two-gpu\]|made and saved|^E " | tail -60 ;;
    twogpu-allreduce)
      python3 tests/gpu/rerender.py .cache/artifacts/qwen3-4b-tp2 2>&1 | tail -2
      timeout ${ALLREDUCE_S:-200} python3 -m infc.cli bench allreduce --artifact .cache/artifacts/qwen3-4b-tp2 \
        --out "$OUT/bench" 2>&1 | quiet | tee "$OUT/allreduce.log" | tail -16 ;;
    server-families)
      # issues 12 and 13: the openai SDK suite through a server over the Qwen3.5 / DeepSeek-V2-Lite
      # cuts at real shapes (random weights made here, the Qwen tokenizer; gpu_families.SERVER),
      # after prepare.py server
      for name in ${SERVER_FAMILIES:-qwen3.5-4b-l8 deepseek-v2-lite-l8}; do
        dir="$MODELS/$name-server"
        t=$(date +%s)
        timeout 300 python3 -c "import sys; sys.path.insert(0, 'tests/gpu'); import gpu_families as g
g.make_model('$name', '$dir', **g.SERVER['$name'])" 2>&1 | tail -3
        cp .cache/gpu/qwen-tokenizer/* "$dir/"
        say "model $name-server ready ($(( $(date +%s) - t )) s); server suite"
        INFC_SERVER_MODEL="$dir" INFC_SERVER_DEVICE=cuda timeout ${SERVER_S:-300} python3 -m pytest \
          tests/test_server.py tests/test_server_disconnect.py -q -p no:cacheprovider -o addopts="" 2>&1 \
          | tee "$OUT/pytest-server-$name.log" | tail -6
        rm -rf "$dir"
      done ;;
    twogpu-nccl-env)
      # NCCL settings swept through `bench allreduce` at the sizes of prefill steps (issue 14: the
      # mixed steps' all-reduces): each entry of NCCL_ENVS is a comma-separated VAR=VALUE list
      # ("default": none), results into bench/nccl-env/<entry>/
      python3 tests/gpu/rerender.py .cache/artifacts/qwen3-4b-tp2 2>&1 | tail -2
      for entry in ${NCCL_ENVS:-default NCCL_MIN_NCHANNELS=32 NCCL_PROTO=Simple NCCL_MIN_NCHANNELS=32,NCCL_PROTO=Simple NCCL_BUFFSIZE=16777216}; do
        say "allreduce with $entry"
        envs=(); [ "$entry" != default ] && IFS=, read -ra envs <<< "$entry"
        mkdir -p "$OUT/bench/nccl-env/$entry"
        env "${envs[@]}" timeout ${ALLREDUCE_S:-120} python3 -m infc.cli bench allreduce --artifact .cache/artifacts/qwen3-4b-tp2 \
          --rows ${ALLREDUCE_ROWS:-64,256,1024,4096,8192} --out "$OUT/bench/nccl-env/$entry" 2>&1 | quiet \
          | tee "$OUT/bench/nccl-env/$entry/allreduce.log" | tail -7
      done ;;
    twogpu-server)
      # model dir:TP:EP[:DP] (DP 2: --data-parallel-size 2 --enable-expert-parallel)
      runs=${TWOGPU_SERVER_RUNS:-qwen3-4b:2:0 ranks-qwen3-30b-a3b-l4:2:1 ranks-qwen3-30b-a3b-l4:1:1:2}
      for run in $runs; do
        set -- ${run//:/ } 1
        t=$(date +%s)
        timeout 300 python3 -c "import sys; sys.path.insert(0,'tests/gpu'); import models, test_ranks_gpu
name = '$1'
test_ranks_gpu.model_dir(name[len('ranks-'):]) if name.startswith('ranks-') else models.model_dir(name)" 2>&1 | tail -3
        cp .cache/gpu/qwen-tokenizer/* "$MODELS/$1/"
        say "model $1 ready ($(( $(date +%s) - t )) s)"
        say "server suite: $1 TP=$2 EP=$3 DP=$4"
        INFC_SERVER_MODEL="$MODELS/$1" INFC_SERVER_DEVICE=cuda INFC_SERVER_TP=$2 INFC_SERVER_EP=$3 INFC_SERVER_DP=$4 \
          timeout ${SERVER_S:-300} python3 -m pytest tests/test_server.py tests/test_server_disconnect.py \
          "tests/test_rank_workers.py::test_infc_serve_exits_with_a_clear_message_when_a_rank_dies" \
          -q -p no:cacheprovider -o addopts="" 2>&1 | tee "$OUT/pytest-server-$1-tp$2-ep$3-dp$4.log" | tail -6
      done ;;
    twogpu-bench)
      cfg=.cache/gpu/configs art=.cache/artifacts
      python3 tests/gpu/rerender.py $art/qwen3-4b* $art/qwen3-30b-a3b* $art/deepseek-v2-lite* 2>&1 | tail -8
      mkdir -p "$OUT/bench"
      for what in ${TWOGPU_BENCH:-latency throughput moe-latency moe-throughput deepseek}; do
        variants=("" "--tensor-parallel-size 2")          # one GPU, then the two ranks
        [ -n "${TWOGPU_SKIP_ONE:-}" ] && variants=("--tensor-parallel-size 2")
        [ -n "${TWOGPU_ONLY_ONE:-}" ] && variants=("")     # one GPU only (another job has the other)
        [ -n "${TWOGPU_NCCL_ONLY:-}" ] && variants+=("nccl-only")     # the ranks again, INFC_P2P=0
        [ -n "${TWOGPU_RANK_SYNC:-}" ] && variants+=("rank-sync")  # again, INFC_RANK_OVERLAP=0
        [ -n "${TWOGPU_EP_GATHER:-}" ] && variants+=("ep-gather")  # again, INFC_EP_GATHER=1
        [ -n "${TWOGPU_DP:-}" ] && variants+=("dp")                # attention data-parallel + EP (MoE)
        [ -n "${TWOGPU_ONLY_DP:-}" ] && variants=("dp")            # only those (a concurrency sweep)
        for ranks in "${variants[@]}"; do
          out="$OUT/bench" p2p=1 rov=1 gather=0
          if [ "$ranks" = nccl-only ]; then ranks="--tensor-parallel-size 2" out="$OUT/bench/nccl-only" p2p=0; fi
          if [ "$ranks" = rank-sync ]; then ranks="--tensor-parallel-size 2" out="$OUT/bench/rank-sync" rov=0; fi
          if [ "$ranks" = ep-gather ]; then ranks="--tensor-parallel-size 2" out="$OUT/bench/ep-gather" gather=1; fi
          dp=""
          if [ "$ranks" = dp ]; then ranks="" dp="--data-parallel-size 2 --enable-expert-parallel" out="$OUT/bench/dp"; fi
          mkdir -p "$out"
          export INFC_P2P=$p2p INFC_RANK_OVERLAP=$rov INFC_EP_GATHER=$gather
          case $what in
            latency|throughput) m=qwen3-4b; tag=${ranks:+-tp2}; x=$ranks ;;
            moe-*) m=qwen3-30b-a3b; tag=${ranks:+-tp2-ep2}; x=${ranks:+$ranks --enable-expert-parallel}
                   [ -n "$dp" ] && { tag=-dp2-ep2; x=$dp; } ;;
            deepseek) m=deepseek-v2-lite; tag=${ranks:+-tp2-ep2}; x=${ranks:+$ranks --enable-expert-parallel} ;;
          esac
          say "bench $what $m${tag:- (one GPU)}"
          case $what in
            latency|moe-latency|deepseek)
              timeout ${LATENCY_S:-240} python3 -m infc.cli bench latency --artifact $art/$m$tag --model-path $cfg/$m \
                --load-format dummy --no-hf --prompts 32,1024 --output-len 128 --out "$out" $x 2>&1 | quiet \
                | tee "$out/$what-$m$tag.log" | tail -4 ;;
            throughput|moe-throughput)
              timeout ${THROUGHPUT_S:-300} python3 -m infc.cli bench throughput --model-path $cfg/$m --load-format dummy \
                --concurrency ${TWOGPU_CONCURRENCY:-256} --out "$out" $x 2>&1 | quiet \
                | tee "$out/$what-$m$tag.log" | grep -E "start|ready|concurrency|execute|wrote|rror" | tail -8 ;;
          esac
        done
      done
      unset INFC_P2P INFC_RANK_OVERLAP INFC_EP_GATHER ;;
    overlap-ab|ab)
      # a runtime switch's default (on) against off on this card, alternating, AB_RUNS times:
      # qwen3-4b bench latency (AB_LATENCY=0 skips it) and bench throughput at AB_CONCURRENCY.
      # overlap-ab: INFC_OVERLAP (overlapped steps); ab: AB_ENV, e.g. INFC_WIDE (wide decode steps)
      var=INFC_OVERLAP; [ "$stage" = ab ] && var=${AB_ENV:?ab needs AB_ENV}
      for run in $(seq ${AB_RUNS:-2}); do
        for ov in 0 1; do
          d="$OUT/$stage/$var$ov-run$run"; [ "$stage" = overlap-ab ] && d="$OUT/overlap-ab/overlap$ov-run$run"
          mkdir -p "$d"
          say "$stage: $var=$ov, run $run"
          if [ "${AB_LATENCY:-1}" != 0 ]; then
            env $var=$ov timeout ${LATENCY_S:-240} python3 -m infc.cli bench latency --artifact .cache/artifacts/qwen3-4b \
              --model-path "$MODELS/qwen3-4b" --no-hf --out "$d" 2>&1 | quiet | tail -4
          fi
          env $var=$ov timeout ${THROUGHPUT_S:-240} python3 -m infc.cli bench throughput --model-path "$MODELS/qwen3-4b" \
            --concurrency ${AB_CONCURRENCY:-64,256} --out "$d" 2>&1 | quiet | grep -E "concurrency|execute" | tail -6
        done
      done ;;
    quant)
      # QUANT_MODELS: models.QUANTIZED names (default: every one); QUANT_SKIP: golden accuracy
      # throughput (steps to leave out)
      mkdir -p "$OUT/quant"
      for q in ${QUANT_MODELS:-$(python3 -c "import sys; sys.path.insert(0,'tests/gpu'); import models; print(' '.join(models.QUANTIZED))")}; do
        art=.cache/artifacts/$q t=$(date +%s)
        timeout ${QUANT_WRITE_S:-900} python3 -c "import sys; sys.path.insert(0,'tests/gpu'); import models
models.model_dir('$q')" 2>&1 | tail -3
        say "quant: $MODELS/$q ready ($(( $(date +%s) - t )) s, $(du -sh "$MODELS/$q" | cut -f1))"
        if [ ! -d $art/bin ]; then
          say "quant: $art has no cubins (prepare.py quant wrote the plan alone: the kernels refused a quantized launch); no GPU steps"
          continue
        fi
        python3 tests/gpu/rerender.py $art 2>&1 | tail -2
        mkdir -p "$OUT/quant/$q"
        case " ${QUANT_SKIP:-} " in *" golden "*) ;; *)
          timeout ${QUANT_GOLDEN_S:-600} python3 -m pytest tests/gpu/test_golden.py -m quant -k "$q" -q -s -p no:cacheprovider \
            ${PYTEST_ARGS:-} 2>&1 | quiet | tee "$OUT/quant/$q/pytest-golden.log" \
            | grep -E "passed|failed|error|regret|^E " | tail -30 ;; esac
        say "quant: bench latency $q"
        timeout ${LATENCY_S:-240} python3 -m infc.cli bench latency --artifact $art \
          --model-path "$MODELS/$q" --no-hf --out "$OUT/quant/$q" ${QUANT_LATENCY_ARGS:-} 2>&1 | quiet | tail -6
        case " ${QUANT_SKIP:-} " in *" throughput "*) ;; *)
          timeout ${THROUGHPUT_S:-240} python3 -m infc.cli bench throughput --model-path "$MODELS/$q" \
            --out "$OUT/quant/$q" ${QUANT_THROUGHPUT_ARGS:-} 2>&1 | quiet | tail -6 ;; esac
        base=$(python3 -c "import sys; sys.path.insert(0,'tests/gpu'); import models; print(models.QUANTIZED['$q'][0])")
        case " ${QUANT_SKIP:-} " in *" accuracy "*) ;; *)
          if [ -d .cache/artifacts/$base/bin ]; then     # against the bf16 model it was written from
            timeout ${QUANT_ACCURACY_S:-300} python3 -m infc.cli bench quant-accuracy --device cuda \
              --reference "$MODELS/$base" --reference-artifact .cache/artifacts/$base \
              --model-path "$MODELS/$q" --artifact $art --sequences 16 --prompt-len 512 --out "$OUT/quant/$q" 2>&1 | tail -3
            # HF's figures for the same checkpoint and sequences, beside infc's
            timeout ${QUANT_ACCURACY_S:-300} python3 tests/gpu/hf_quant_accuracy.py --reference "$MODELS/$base" \
              --model-path "$MODELS/$q" --sequences 16 --prompt-len 512 --out "$OUT/quant/$q" 2>&1 | tail -3
          else
            say "quant: no bf16 artifact of $base here (.cache/artifacts/$base): no accuracy run for $q"
          fi ;; esac
      done
      # whole models with dummy weights (prepare.py QUANT_DUMMY: no checkpoint to write), each
      # beside its bf16 build where prepare.py made one (.cache/artifacts/<base>); QUANT_DUMMY_MODELS
      # picks, QUANT_SKIP dummy leaves them out
      case " ${QUANT_SKIP:-} " in *" dummy "*) ;; *)
        for q in ${QUANT_DUMMY_MODELS:-$(python3 -c "import sys; sys.path.insert(0,'tests/gpu'); import prepare; print(' '.join(prepare.QUANT_DUMMY))")}; do
          base=$(python3 -c "import sys; sys.path.insert(0,'tests/gpu'); import prepare; print(prepare.QUANT_DUMMY['$q'][0])")
          for a in $q $base; do
            [ -d .cache/artifacts/$a/bin ] || { say "quant: no cubins in .cache/artifacts/$a: not timed"; continue; }
            python3 tests/gpu/rerender.py .cache/artifacts/$a 2>&1 | tail -1
            mkdir -p "$OUT/quant/$a-dummy"
            say "quant: bench latency $a (dummy weights)"
            timeout ${LATENCY_S:-300} python3 -m infc.cli bench latency --artifact .cache/artifacts/$a \
              --model-path .cache/gpu/configs/$a --load-format dummy --no-hf --out "$OUT/quant/$a-dummy" \
              ${QUANT_LATENCY_ARGS:-} 2>&1 | quiet | tail -6
          done
          # where the fp8 step's time goes, per launch (the experts' codes form against the rest)
          timeout ${PROFILE_S:-240} python3 -m infc.cli bench profile --artifact .cache/artifacts/$q \
            --model-path .cache/gpu/configs/$q --load-format dummy --out "$OUT/quant/$q-dummy" \
            --steps decode_b1,decode_b1_graph --reps 10 2>&1 | quiet | tail -60
        done ;; esac
      # the bf16 model beside them, same call (QUANT_SKIP bf16 leaves it out)
      case " ${QUANT_SKIP:-} " in *" bf16 "*) ;; *)
        mkdir -p "$OUT/quant/qwen3-4b"
        say "quant: bench latency qwen3-4b (bf16)"
        timeout ${LATENCY_S:-240} python3 -m infc.cli bench latency --artifact .cache/artifacts/qwen3-4b \
          --model-path "$MODELS/qwen3-4b" --no-hf --out "$OUT/quant/qwen3-4b" ${QUANT_LATENCY_ARGS:-} 2>&1 | quiet | tail -6 ;; esac ;;
    kv-fp8)
      # batch-1 decode at 1k and 32k of context with the fp8 KV cache against the bf16 one, same
      # model directory and card (after prepare.py base kvfp8); KV_FP8_PROMPTS sets the prompts,
      # KV_FP8_ARTS the artifacts (under .cache/artifacts, built from qwen3-4b's config)
      mkdir -p "$OUT/kv-fp8"
      for art in ${KV_FP8_ARTS:-qwen3-4b qwen3-4b-kvfp8}; do
        python3 tests/gpu/rerender.py .cache/artifacts/$art 2>&1 | tail -1
        say "kv-fp8: bench latency $art"
        timeout ${LATENCY_S:-300} python3 -m infc.cli bench latency --artifact .cache/artifacts/$art \
          --model-path "$MODELS/qwen3-4b" --no-hf --prompts ${KV_FP8_PROMPTS:-1024,32768} \
          --out "$OUT/kv-fp8" 2>&1 | quiet | tail -5
        # (both plans are model "qwen3-4b": keep each run's file under its artifact's name)
        mv "$OUT"/kv-fp8/latency-qwen3-4b-*.json "$OUT/kv-fp8/$art.json" 2>/dev/null
      done ;;
    lora)
      # issue 46 (after prepare.py base lora): the multi-LoRA golden gate against HF + PEFT
      # (tests/gpu/test_lora_gpu.py), then bench throughput (1024/128) at LORA_CONCURRENCY of the base
      # qwen3-4b and of qwen3-4b --enable-lora serving 8 rank-16 adapters that the requests take in
      # turn (every step mixes them), alternating LORA_RUNS times; LORA_SKIP_GATE=1 skips the gate
      mkdir -p "$OUT/lora"
      if [ -z "${LORA_SKIP_GATE:-}" ]; then
        timeout ${LORA_GATE_S:-300} python3 -m pytest tests/gpu/test_lora_gpu.py -q -s -p no:cacheprovider 2>&1 | quiet \
          | tee "$OUT/pytest-lora.log" | grep -E "passed|failed|error|regret|^E " | tail -20
      fi
      mods=""
      for i in 1 2 3 4 5 6 7 8; do
        python3 tools/make_lora_adapter.py --model "$MODELS/qwen3-4b" --out /tmp/infc-adapters/r16-$i \
          --rank 16 --alpha 32 --seed $i --dtype bf16 >/dev/null
        mods="$mods a$i=/tmp/infc-adapters/r16-$i"
      done
      python3 tests/gpu/rerender.py .cache/artifacts/qwen3-4b-lora8r16 2>&1 | tail -1
      for run in $(seq ${LORA_RUNS:-1}); do
        say "lora: bench throughput base (run $run)"
        timeout ${THROUGHPUT_S:-300} python3 -m infc.cli bench throughput --model-path "$MODELS/qwen3-4b" \
          --concurrency ${LORA_CONCURRENCY:-1,32,256} --out "$OUT/lora" 2>&1 | quiet \
          | grep -E "concurrency|wrote|rror" | tail -6
        say "lora: bench throughput with 8 adapters (run $run)"
        timeout ${THROUGHPUT_S:-300} python3 -m infc.cli bench throughput --model-path "$MODELS/qwen3-4b" \
          --concurrency ${LORA_CONCURRENCY:-1,32,256} --enable-lora --max-loras 8 --max-lora-rank 16 \
          --lora-modules $mods --out "$OUT/lora" 2>&1 | quiet | grep -E "concurrency|wrote|rror" | tail -6
        for f in "$OUT"/lora/throughput-qwen3-4b-[!r]*.json; do case $f in *-run*) ;; *) cp "$f" "${f%.json}-run$run.json" ;; esac; done
      done ;;
    lora-profile)
      # issue 46: bench profile (per launch) of the base qwen3-4b and of qwen3-4b --enable-lora with
      # random rank-16 adapters in its 8 slots, the sequences taking them in turn (LORA_PROFILE_STEPS;
      # LORA_PROFILE_ARTS: the LoRA builds, default qwen3-4b-lora8r16, e.g. "qwen3-4b-lora8r16
      # qwen3-4b-lora8r16-rows" after prepare.py lora lora-rows; LORA_PROFILE_ARGS: more flags,
      # e.g. "--mixed-decodes 32" for a 32-sequence decode step)
      arts=${LORA_PROFILE_ARTS:-qwen3-4b-lora8r16}
      for a in $arts; do
        if [ -f .cache/artifacts/$a/lora_site_probe ]; then   # a patched template's build: its own re-render
          python3 tools/experiments/lora_site_probe.py rerender $(cat .cache/artifacts/$a/lora_site_probe) 2>&1 | tail -1
        else
          python3 tests/gpu/rerender.py .cache/artifacts/$a 2>&1 | tail -1
        fi
      done
      mkdir -p "$OUT/lora-profile"
      for spec in "qwen3-4b 0" $(for a in $arts; do echo "$a:8"; done); do
        set -- ${spec/:/ }
        say "lora-profile: $1 with $2 adapters"
        timeout ${PROFILE_S:-200} python3 -m infc.cli bench profile --artifact .cache/artifacts/$1 --model-path "$MODELS/qwen3-4b" \
          --loras $2 --reps 10 --steps ${LORA_PROFILE_STEPS:-decode_b1,decode_b1_graph,mixed_256,decode_wide} \
          ${LORA_PROFILE_ARGS:-} --out "$OUT/lora-profile/$1" 2>&1 | quiet | grep -vE "^\|" | tail -12
      done ;;
    tier-throughput)
      # issue 44: 1024/128 throughput of qwen3-4b (dummy weights) at TIER_CONCURRENCY (default 256)
      # with the host KV tier off and on (--kv-offloading-size TIER_GIB, default 32: every finished
      # sequence's blocks are copied out), alternating TIER_RUNS (default 2) times, same engine flags
      # otherwise. TIER_VARIANTS (default "off on") names the runs: off, on, or NAME=ENV=VALUE,...
      # (the tier on under those variables, e.g. mapped=INFC_KV_SAVE_STAGING_BYTES=0): *-NAME-runN.json;
      # TIER_ARGS adds flags to bench throughput (default --step-series: every step's time and the
      # tier's copies and waits by then, to tell which steps a tier slows)
      mkdir -p "$OUT/tier"
      for run in $(seq ${TIER_RUNS:-2}); do
        for v in ${TIER_VARIANTS:-off on}; do
          name=${v%%=*} envs= gib=${TIER_GIB:-32}
          case $v in *=*) envs=$(echo "${v#*=}" | tr , ' ') ;; off) gib=0 ;; esac
          say "tier-throughput: $name, --kv-offloading-size $gib $envs (run $run)"
          env $envs timeout ${THROUGHPUT_S:-300} python3 -m infc.cli bench throughput \
            --model-path .cache/gpu/configs/qwen3-4b --load-format dummy --concurrency ${TIER_CONCURRENCY:-256} \
            --kv-offloading-size $gib --out "$OUT/tier" ${TIER_ARGS:---step-series} 2>&1 | quiet \
            | grep -E "concurrency|host KV tier|wrote|rror" | tail -5
          f=$(ls -t "$OUT"/tier/throughput-*.json | grep -v -- '-run[0-9]*\.json$' | head -1)
          cp "$f" "${f%.json}-$name-run$run.json"
        done
      done ;;
    tier-probe)
      # issue 44: each variant of tools/experiments/tier_hit_probe.py in its own process (TIER_PROBE
      # picks them): warm +16 hits at 16k / 32k beside the tier's saves, one piece of them left out
      mkdir -p "$OUT/tier-probe"
      # (an entry NAME=ENV=VALUE,ENV=VALUE runs variant `on` under those variables, e.g.
      # p8=INFC_KV_SAVE_PROGRAMS=8)
      for v in ${TIER_PROBE:-off on chained=INFC_KV_SAVE_CHAINED=1 settle mapped=INFC_KV_SAVE_STAGING_BYTES=0 nocopy}; do
        name=${v%%=*} var=on envs=
        case $v in *=*) envs=$(echo "${v#*=}" | tr , ' ') ;; *) var=$v ;; esac
        env $envs timeout ${PROBE_S:-90} python3 tools/experiments/tier_hit_probe.py .cache/gpu/configs/qwen3-4b \
          "$OUT/tier-probe/$name.json" $var --lengths ${PROBE_LENGTHS:-16384,32768} 2>&1 | quiet \
          | grep -E "L=|rror" | sed "s/^on     /$name /" | tail -6
      done ;;
    cut-latency)
      # issue 45: batch-1 TPOT / TTFT of the golden gates' layer cuts (CUTS, each prepared by
      # `INFC_GPU_FAMILIES=<cut> prepare.py families`) with dummy weights, against the active floor,
      # and with CUT_PROFILE_STEPS their steps per launch
      for name in ${CUTS:-gpt-oss-20b-l4 deepseek-v3-l5}; do
        art=.cache/gpu/$name-art cfg=.cache/gpu/configs/$name
        mkdir -p "$OUT/cut-latency/$name"
        python3 tests/gpu/rerender.py $art 2>&1 | tail -1
        timeout ${LATENCY_S:-150} python3 -m infc.cli bench latency --artifact $art --model-path $cfg \
          --load-format dummy --no-hf --prompts ${CUT_PROMPTS:-1024} --output-len 128 --out "$OUT/cut-latency/$name" \
          2>&1 | quiet | tail -4
        for f in "$OUT/cut-latency/$name"/latency-*.json; do
          [ -f "$f" ] && python3 -m infc.bench.active_floor --artifact $art --latency "$f" --output-len 128 2>&1 | tail -4
        done
        # CUT_PROFILE_STEPS (e.g. decode_b1): the cut's steps per launch as well (bench profile)
        [ -n "${CUT_PROFILE_STEPS:-}" ] && timeout ${PROFILE_S:-150} python3 -m infc.cli bench profile --artifact $art \
          --model-path $cfg --load-format dummy --out "$OUT/cut-latency/$name" --steps $CUT_PROFILE_STEPS --reps 10 \
          2>&1 | quiet | grep -E "^\| [0-9]+ \||all launches|wall" | head -20
      done ;;
    gptoss)
      # issue 45: GPT-OSS-20B at full depth (24 layers, MXFP4 experts, dummy weights, prepare.py
      # gptoss): batch-1 TPOT / TTFT against the active floor, the decode step per launch, and
      # 1024/1024 throughput at GPTOSS_CONCURRENCY (TensorRT-LLM publishes 13,890 tok/s an H200).
      # GPTOSS_ARTS: the artifacts to run, in turn (prepare.py gptoss builds gpt-oss-20b-art and
      # gpt-oss-20b-noup-art, compiler/passes/upcast_experts.py off: the upcast A/B), each
      # into $OUT/gptoss/<artifact>; GPTOSS_PROFILE_ARGS: bench profile's own (e.g. "--mixed-chunk
      # 4096 --mixed-prompts 4" with GPTOSS_PROFILE_STEPS=mixed_256: a many-token mixed step)
      cfg=.cache/gpu/configs/gpt-oss-20b
      rm -rf "$OUT/gptoss"
      for art in ${GPTOSS_ARTS:-.cache/gpu/gpt-oss-20b-art .cache/gpu/gpt-oss-20b-noup-art}; do
        o="$OUT/gptoss/$(basename $art)"; mkdir -p "$o"
        python3 tests/gpu/rerender.py $art 2>&1 | tail -2
        timeout ${LATENCY_S:-240} python3 -m infc.cli bench latency --artifact $art --model-path $cfg \
          --load-format dummy --no-hf --prompts ${GPTOSS_PROMPTS:-32,1024} --output-len 128 --out "$o" 2>&1 | quiet | tail -8
        for f in "$o"/latency-*.json; do
          [ -f "$f" ] && python3 -m infc.bench.active_floor --artifact $art --latency "$f" --output-len 128 2>&1 | tail -8
        done
        [ "${GPTOSS_PROFILE:-1}" != 0 ] && timeout ${PROFILE_S:-150} python3 -m infc.cli bench profile --artifact $art \
          --model-path $cfg --load-format dummy --out "$o" --steps ${GPTOSS_PROFILE_STEPS:-decode_b1} --reps 10 \
          ${GPTOSS_PROFILE_ARGS:-} \
          2>&1 | quiet | tail -60
        [ "${GPTOSS_CONCURRENCY:-256}" != 0 ] && timeout ${THROUGHPUT_S:-300} python3 -m infc.cli bench throughput \
          --artifact $art --model-path $cfg --load-format dummy --input-len 1024 --output-len 1024 \
          --concurrency ${GPTOSS_CONCURRENCY:-256} --out "$o" 2>&1 | quiet | grep -E "concurrency|wrote|rror" | tail -4
      done ;;
    tier-prefix)
      mkdir -p "$OUT/tier-prefix"
      p="python3 -m infc.cli bench prefix --model-path .cache/gpu/configs/qwen3-4b --load-format dummy --path engine
         --lengths ${TIER_PREFIX_LENGTHS:-16384,32768} --reps 5 --cold-reps 2"
      for run in $(seq ${TIER_RUNS:-2}); do
        for gib in 0 ${TIER_GIB:-16}; do
          say "tier-prefix: HBM hits, --kv-offloading-size $gib (run $run)"
          a=; [ "$gib" != 0 ] && a="--kv-offloading-size $gib"
          timeout ${PREFIX_S:-120} $p $a --out "$OUT/tier-prefix/hbm-$gib-run$run" 2>&1 | quiet | grep -E "L=|wrote|rror"
        done
      done
      say "tier-prefix: hits from the host tier"
      timeout ${PREFIX_S:-120} $p --tier host --kv-offloading-size ${TIER_GIB:-16} --out "$OUT/tier-prefix/host" 2>&1 \
        | quiet | grep -E "L=|restore|wrote|rror" ;;
    tune)
      # `infc tune run` of each folder .cache/tune/<d> of TUNE_DIRS (default qwen3-4b-h200) that
      # `infc tune prepare` wrote here (carry it: tests/gpu/carry.sh tune/<d>): the timed table
      # in $OUT/<d>/h200.json, to lay over codegen_templates/tuning/h200.json by hand
      for d in ${TUNE_DIRS:-qwen3-4b-h200}; do
        mkdir -p "$OUT/$d"
        timeout ${TUNE_S:-300} python3 -m infc.cli tune run --dir ".cache/tune/$d" --results-dir "$OUT/$d" \
          --write "$OUT/$d/h200.json" 2>&1 | tail -40
      done ;;
    lora-tune)
      for d in qwen3-4b-narrow-h200 qwen3-4b-lora8r16-narrow-h200; do
        say "lora-tune: infc tune run $d"
        timeout ${TUNE_S:-300} python3 -m infc.cli tune run --dir ".cache/tune/$d" --results-dir "$OUT/$d" \
          --write "$OUT/$d/h200.json" ${TUNE_ARGS:-} > "$OUT/$d.log" 2>&1; tail -12 "$OUT/$d.log"
      done
      python3 tools/experiments/lora_gemv_probe.py report "$OUT" 2>&1 | tee "$OUT/lora-tune.txt" ;;
    *)
      say "unknown stage '$stage' (tests/gpu/run.sh --list names them)"; exit 2 ;;
  esac
done
say "done"
ls "$OUT"
