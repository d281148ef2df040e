#!/usr/bin/env bash
# One single-GPU call whose stages depend on the card that came (a call for nvidia-h200 gets an
# H100 or an H200):
#   ON_H200="latency prefix throughput moe deepseek serve" ON_H100="" bash tests/gpu/call_one.sh $OUT
# runs session.sh with ON_H200's stages on an H200 and ON_H100's on an H100; an empty list ends
# the call at once (a few seconds of device time, plus the machine's start). Carry what the stages
# need (tests/gpu/carry.sh), for the default H200 list: after `tests/gpu/prepare.py base twogpu
# deepseek`, gpu/configs gpu/tiny-moe gpu/skipgram gpu/qwen-tokenizer gpu/deepseek-v2-lite-art
# artifacts/qwen3-4b artifacts/qwen3-30b-a3b.
set -uo pipefail
OUT=${1:?OUT}
cd "$(dirname "$0")/../.."
mkdir -p "$OUT"
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $card" | tee "$OUT/card.txt"
case $card in
  *H200*) stages=${ON_H200:-latency prefix throughput moe deepseek serve} ;;
  *) stages=${ON_H100:-} ;;
esac
[ -z "$stages" ] && { echo "nothing to run on this card"; exit 0; }
bash tests/gpu/carry.sh --unpack
STAGES="$stages" bash tests/gpu/session.sh "$OUT/s" >"$OUT/console.log" 2>&1
tail -40 "$OUT/console.log"
