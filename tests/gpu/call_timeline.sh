#!/usr/bin/env bash
# Graph-replay timelines (tests/gpu/timeline.py) of batch-1 decode for several builds of one model:
#   ARTS="qwen3-4b qwen3-4b:INFC_NARROW=0" CFG=.cache/gpu/configs/qwen3-4b CONTEXTS=32,1024 \
#     bash tests/gpu/call_timeline.sh $OUT
# ARTS as in call_ab_latency.sh (NAME[:VAR=VALUE], under .cache/artifacts); on an H100 each NAME
# without an -h100 twin is used as it is.
. "$(dirname "$0")/call_start.sh" "$@"
install_here
CFG=${CFG:?CFG}
for a in $ARTS; do
  name=${a%%:*}; env_=""; case "$a" in *:*) env_=${a#*:};; esac
  for c in ${CONTEXTS//,/ }; do
    label=$(echo "$a" | tr ':=' '--')-$c
    echo "== $a at context $c"
    env $env_ timeout 300 python3 tests/gpu/timeline.py --artifact ".cache/artifacts/$name" --model-path "$CFG" \
      --context "$c" --reps "${REPS:-20}" --out "$OUT/tl-$label" > "$OUT/tl-$label.log" 2>&1
    tail -32 "$OUT/tl-$label.log"
  done
done
