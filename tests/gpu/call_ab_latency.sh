#!/usr/bin/env bash
# Batch-1 latency of several builds of one model, in alternating rounds on one GPU, then a
# per-launch profile of batch-1 decode for each (one call; an A/B of a kernel or launch change):
#   ARTS="qwen3-30b-a3b qwen3-30b-a3b-pdl" CFG=.cache/gpu/configs/qwen3-30b-a3b \
#     bash tests/gpu/call_ab_latency.sh $OUT
# ARTS: directories under .cache/artifacts (carried with tests/gpu/carry.sh, with gpu/configs), each
# optionally NAME:VAR=VALUE, run with that environment (e.g. qwen3-4b:INFC_NARROW=0: one build's
# narrow program against its decode program); results are named NAME-VAR-VALUE;
# CFG: the model directory (config only: weights made on the device, --load-format dummy);
# PROMPTS (32), ROUNDS (2), PROFILE (1: profile each build; 0: not).
. "$(dirname "$0")/call_start.sh" "$@"
install_here
CFG=${CFG:?CFG}
for a in $ARTS; do python3 tests/gpu/rerender.py ".cache/artifacts/$(art "$a")" 2>&1 | tail -1; done
for round in $(seq 1 ${ROUNDS:-2}); do
  for a in $ARTS; do
    echo "== $a, round $round"
    env $(envs "$a") timeout 200 python3 -m infc.cli bench latency --artifact ".cache/artifacts/$(art "$a")" \
      --model-path "$CFG" --load-format dummy --no-hf --prompts "${PROMPTS:-32}" --output-len 128 \
      --out "$OUT/$(label "$a")-$round" > "$OUT/$(label "$a")-$round.log" 2>&1
    grep -E "infc prompt" "$OUT/$(label "$a")-$round.log"
  done
done
[ "${PROFILE:-1}" = 1 ] && for a in $ARTS; do
  echo "== profile $a"
  env $(envs "$a") timeout 200 python3 -m infc.cli bench profile --artifact ".cache/artifacts/$(art "$a")" \
    --model-path "$CFG" --load-format dummy --steps decode_b1 --reps 10 --out "$OUT/profile-$(label "$a")" \
    > "$OUT/profile-$(label "$a").log" 2>&1
  grep -E "^decode_b1|^\| [0-9]+ \| " "$OUT/profile-$(label "$a").log" | head -16
done
