#!/usr/bin/env bash
# Graph-replay timelines (tests/gpu/timeline.py) of batch-1 decode for several builds of one model:
#   ARTS="qwen3-4b qwen3-4b:INFC_NARROW=0" CFG=.cache/gpu/configs/qwen3-4b CONTEXTS=32,1024 \
#     bash tests/gpu/call_timeline.sh $OUT
# ARTS as in call_ab_latency.sh (NAME[:VAR=VALUE], under .cache/artifacts), used as named.
. "$(dirname "$0")/call_start.sh" "$@"
install_here
CFG=${CFG:?CFG}
for a in $ARTS; do
  for c in ${CONTEXTS//,/ }; do
    out="$OUT/tl-$(label "$a")-$c"
    echo "== $a at context $c"
    env $(envs "$a") timeout 300 python3 tests/gpu/timeline.py --artifact ".cache/artifacts/$(art "$a")" \
      --model-path "$CFG" --context "$c" --reps "${REPS:-20}" --out "$out" > "$out.log" 2>&1
    tail -32 "$out.log"
  done
done
