#!/usr/bin/env bash
# One nvidia-h200-x2 call (issue 14 first, issue 10 beside it), whichever cards come:
#   tests/gpu/prepare.py base twogpu; tests/gpu/carry.sh <the list below>; then on the device
#   bash tests/gpu/call_twogpu.sh $OUT
# Phase A, in parallel: GPU 0 the one-GPU side of qwen3-30b-a3b's saturated throughput; GPU 1
# qwen3-4b's issue-10 benchmarks and the MoE / DeepSeek batch-1 latency (GPU1_H200_STAGES,
# GPU1_H100_STAGES). Phase B, both GPUs: the two ranks.
# Carry: gpu/configs gpu/ranks/configs gpu/tiny-moe gpu/skipgram gpu/qwen-tokenizer gpu/deepseek-v2-lite-art
#   artifacts/{qwen3-4b,qwen3-4b-tp2,qwen3-30b-a3b,qwen3-30b-a3b-tp2-ep2,
#   ranks-qwen3-30b-a3b-l4-tp2-ep2,deepseek-v2-lite-l8-tp2-ep2}
. "$(dirname "$0")/call_start.sh" "$@"
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $card" | tee "$OUT/card.txt"
conc=${MOE_CONCURRENCY:-256,1024}
if [ "${ONE_GPU:-1}" = 0 ] && [[ $card != *H200* ]]; then
  echo "ONE_GPU=0 on $card: phase A skipped"
else
( export CUDA_VISIBLE_DEVICES=0
  mkdir -p "$OUT/moe-one"
  STAGES=twogpu-bench TWOGPU_BENCH=moe-throughput TWOGPU_CONCURRENCY=$conc TWOGPU_ONLY_ONE=1 \
    bash tests/gpu/session.sh "$OUT/moe-one" >"$OUT/moe-one/console.log" 2>&1 ) &
a=$!
( export CUDA_VISIBLE_DEVICES=1
  sleep 25     # session.sh installs the package: the two must not race
  # issue 10 (qwen3-4b), then issues 11 and 13 (batch-1 TPOT against the active floor); an H100
  # pair re-times only the batch-1 latencies (its issue-10 throughput numbers are in)
  case $card in
    *H200*) stages=${GPU1_H200_STAGES:-latency prefix throughput latency moe deepseek serve} ;;
    *) stages=${GPU1_H100_STAGES:-latency moe deepseek} ;;
  esac
  STAGES="$stages" bash tests/gpu/session.sh "$OUT/gpu1" >"$OUT/gpu1.log" 2>&1
  ) &
b=$!
wait $a $b
fi
mkdir -p "$OUT/ranks"
# the ranks overlap their steps by default; RANK_SYNC=1 times them synchronous too, DP=1 the
# attention data-parallel ranks (--data-parallel-size 2 --enable-expert-parallel), EP_GATHER=1
# with the dispatch's all-gather back (INFC_EP_GATHER), TWOGPU_TEST=1 runs the two-GPU test file
# (golden gates, overlapped tokens, a killed rank); ONE_GPU=0 skips phase A
STAGES="twogpu-bench" TWOGPU_BENCH=moe-throughput TWOGPU_CONCURRENCY=$conc TWOGPU_SKIP_ONE=1 \
  TWOGPU_RANK_SYNC=${RANK_SYNC:-} TWOGPU_EP_GATHER=${EP_GATHER:-} TWOGPU_DP=${DP:-} bash tests/gpu/session.sh "$OUT/ranks" >"$OUT/ranks/console.log" 2>&1 || true
if [ -n "${TWOGPU_TEST:-}" ]; then
  STAGES=twogpu TWOGPU_S=240 bash tests/gpu/session.sh "$OUT/twogpu-test" >"$OUT/twogpu-test.log" 2>&1
fi
