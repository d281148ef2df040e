#!/usr/bin/env bash
# Batch-1 latency of several builds of one model, in alternating rounds on one GPU, then a
# per-launch profile of batch-1 decode for each (one call; an A/B of a kernel or launch change):
#   ARTS="qwen3-30b-a3b qwen3-30b-a3b-pdl" CFG=.cache/gpu/configs/qwen3-30b-a3b \
#     bash tests/gpu/call_ab_latency.sh $OUT
# ARTS: directories under .cache/artifacts (carried with tests/gpu/carry.sh, with gpu/configs);
# CFG: the model directory (config only: weights made on the device, --load-format dummy);
# PROMPTS (32), ROUNDS (2), PROFILE (1: profile each build; 0: not).
. "$(dirname "$0")/call_start.sh" "$@"
install_here
CFG=${CFG:?CFG}
for a in $ARTS; do python3 tests/gpu/rerender.py ".cache/artifacts/$a" 2>&1 | tail -1; done
for round in $(seq 1 ${ROUNDS:-2}); do
  for a in $ARTS; do
    echo "== $a, round $round"
    timeout 200 python3 -m infc.cli bench latency --artifact ".cache/artifacts/$a" --model-path "$CFG" \
      --load-format dummy --no-hf --prompts "${PROMPTS:-32}" --output-len 128 --out "$OUT/$a-$round" \
      > "$OUT/$a-$round.log" 2>&1
    grep -E "infc prompt" "$OUT/$a-$round.log"
  done
done
[ "${PROFILE:-1}" = 1 ] && for a in $ARTS; do
  echo "== profile $a"
  timeout 200 python3 -m infc.cli bench profile --artifact ".cache/artifacts/$a" --model-path "$CFG" \
    --load-format dummy --steps decode_b1 --reps 10 --out "$OUT/profile-$a" > "$OUT/profile-$a.log" 2>&1
  grep -E "^decode_b1|^\| [0-9]+ \| " "$OUT/profile-$a.log" | head -16
done
