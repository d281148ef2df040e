#!/usr/bin/env bash
# Per-launch profiles of the same steps for several builds of one model, in alternating rounds on
# one GPU (what call_ab_throughput.sh does for whole runs, one step at a time):
#   ARTS="qwen3-4b-head qwen3-4b-il" CFG=.cache/gpu/configs/qwen3-4b \
#     PROFILES="--steps mixed_256 --mixed-decodes 194 --mixed-context 1100 --mixed-chunk 7800 --mixed-prompts 8;--steps decode_b1_graph" \
#     bash tests/gpu/call_ab_profile.sh $OUT
# ARTS: directories under .cache/artifacts built by tests/gpu/build_at.py (NAME for an H200,
# NAME-h100 for an H100: the card that came picks); PROFILES: `bench profile` argument sets,
# separated by ';' (each run as profile-<i>); ROUNDS (1). Prints each step's summary row.
# Carry: tests/gpu/carry.sh gpu/configs artifacts/NAME artifacts/NAME-h100 ...
. "$(dirname "$0")/call_start.sh" "$@"
install_here
CFG=${CFG:?CFG}
IFS=';' read -r -a sets <<< "${PROFILES:?PROFILES}"
for round in $(seq 1 ${ROUNDS:-1}); do
  for i in "${!sets[@]}"; do
    for a in $ARTS; do
      d="$OUT/$a-p$i-$round"
      # shellcheck disable=SC2086  # each set is a list of arguments
      timeout 200 python3 -m infc.cli bench profile --artifact ".cache/artifacts/$a$suffix" --model-path "$CFG" \
        --load-format dummy --reps 10 --no-bandwidth --out "$d" ${sets[$i]} > "$d.log" 2>&1
      grep -E "^\| (decode|mixed|prefill|prefix)[a-z_0-9]* \| [a-z]" "$d.log" | sed "s/^/$a$suffix p$i r$round: /"
    done
  done
done
