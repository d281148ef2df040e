#!/usr/bin/env bash
# One nvidia-h200-x2 call (issue 14 first, issue 10 beside it), whichever cards come:
#   tests/gpu/prepare.py base twogpu; tests/gpu/carry.sh <the list below>; then on the device
#   bash tests/gpu/call_twogpu.sh $OUT
# Phase A, in parallel: GPU 0 the one-GPU side of qwen3-30b-a3b's saturated throughput; GPU 1
# qwen3-4b's issue-10 benchmarks (on H200s) or the batch-budget sweep (on H100s, whose issue-10
# numbers are in). Phase B, both GPUs: the two ranks with and without overlapped steps, then the
# rank-overlap token test.
# Carry: gpu/configs gpu/ranks/configs gpu/tiny-moe gpu/skipgram gpu/qwen-tokenizer
#   artifacts/{qwen3-4b,qwen3-4b-tp2,qwen3-30b-a3b,qwen3-30b-a3b-tp2-ep2,
#   ranks-qwen3-30b-a3b-l4-tp2-ep2,deepseek-v2-lite-l8-tp2-ep2}
set -uo pipefail
OUT=${1:?OUT}
cd "$(dirname "$0")/../.."
bash tests/gpu/carry.sh --unpack
mkdir -p "$OUT"
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $card" | tee "$OUT/card.txt"
conc=${MOE_CONCURRENCY:-256,1024}
( export CUDA_VISIBLE_DEVICES=0
  mkdir -p "$OUT/moe-one"
  STAGES=twogpu-bench TWOGPU_BENCH=moe-throughput TWOGPU_CONCURRENCY=$conc TWOGPU_ONLY_ONE=1 \
    bash tests/gpu/session.sh "$OUT/moe-one" >"$OUT/moe-one/console.log" 2>&1 ) &
a=$!
( export CUDA_VISIBLE_DEVICES=1
  sleep 25     # session.sh installs the package: the two must not race
  if echo "$card" | grep -q H200; then
    STAGES="latency prefix throughput latency" bash tests/gpu/session.sh "$OUT/qwen3-4b" >"$OUT/qwen3-4b.log" 2>&1
  else
    mkdir -p "$OUT/budget"
    STAGES=generate bash tests/gpu/session.sh "$OUT/budget" >/dev/null 2>&1   # makes the models
    for n in 2048 4096 8192; do
      timeout 150 python3 -m infc.cli bench throughput --model-path /tmp/infc-models/qwen3-4b \
        --max-num-batched-tokens $n --concurrency 64,256 --out "$OUT/budget/b$n" 2>&1 \
        | grep -E "concurrency|execute|wrote|rror" >>"$OUT/budget/console.log"
    done
    timeout 60 python3 bench/experiments/gemv_l2.py "$OUT/gemv-l2" >"$OUT/gemv-l2.log" 2>&1
  fi ) &
b=$!
wait $a $b
mkdir -p "$OUT/ranks"
STAGES="twogpu-bench" TWOGPU_BENCH=moe-throughput TWOGPU_CONCURRENCY=$conc TWOGPU_SKIP_ONE=1 TWOGPU_RANK_SYNC=1 \
  bash tests/gpu/session.sh "$OUT/ranks" >"$OUT/ranks/console.log" 2>&1 || true
STAGES=twogpu PYTEST_ARGS="-k overlapped" TWOGPU_S=120 bash tests/gpu/session.sh "$OUT/overlap-test" \
  >"$OUT/overlap-test.log" 2>&1
