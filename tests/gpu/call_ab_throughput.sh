#!/usr/bin/env bash
# `bench throughput` of several builds of one model in alternating rounds on one GPU (an A/B of a
# plan change at concurrency; call_ab_latency.sh is its batch-1 twin), after optional isolated
# kernel timings (`infc tune run`):
#   ARTS="qwen3-4b-base qwen3-4b-new" CFG=.cache/gpu/configs/qwen3-4b \
#     TUNE=qwen3-4b-h100-widegemm bash tests/gpu/call_ab_throughput.sh $OUT
# ARTS: directories under .cache/artifacts built by tests/gpu/build_at.py: NAME holds the H200
# table's plan, NAME-h100 the H100's, and the card that came picks (each run as built:
# --artifact); CFG: the model directory (config only: weights made on the device, --load-format
# dummy); CONCURRENCY (64,256), ROUNDS (2), BUDGETS (each value a run's
# --max-num-batched-tokens, results named NAME-bBUDGET-ROUND; default: the engine's, NAME-bdefault-ROUND); TUNE: folders under .cache/tune that `infc tune
# prepare` wrote, timed first with `infc tune run --any-gpu` (their tables are written under
# $OUT, never into the checkout). Carry: tests/gpu/carry.sh gpu/configs artifacts/NAME
# artifacts/NAME-h100 ... tune/FOLDER ...
. "$(dirname "$0")/call_start.sh" "$@"
install_here
CFG=${CFG:?CFG}
for t in ${TUNE:-}; do
  echo "== tune run $t"
  timeout 300 python3 -m infc.cli tune run --dir ".cache/tune/$t" --any-gpu --write "$OUT/tune-$t.json" \
    --results-dir "$OUT" > "$OUT/tune-$t.log" 2>&1
  tail -25 "$OUT/tune-$t.log"
done
for round in $(seq 1 ${ROUNDS:-2}); do
  for a in $ARTS; do for b in ${BUDGETS:-default}; do
    art=".cache/artifacts/$a$suffix"
    name="$a-b$b-$round"
    echo "== $a$suffix, budget $b, round $round"
    timeout 300 python3 -m infc.cli bench throughput --artifact "$art" --model-path "$CFG" --load-format dummy \
      --concurrency "${CONCURRENCY:-64,256}" $([ "$b" = default ] || echo --max-num-batched-tokens "$b") --out "$OUT/$name" > "$OUT/$name.log" 2>&1
    grep -E "^concurrency|execute|decode|mixed" "$OUT/$name.log" | head -12
  done; done
done
