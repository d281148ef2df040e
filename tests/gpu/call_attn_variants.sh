#!/usr/bin/env bash
# Issue 10's prefix-hit attention in one call on one GPU (bench/NOTES.md, "Issue 10's prefix-hit
# attention"): the short program's attention_mixed launch, per layer, in the step and issued alone
# (bench profile --isolate), for qwen3-4b as built and for each variant of its split-role tunables
# (tests/gpu/prepare.py ATTN_VARIANTS), at a 1k and a 16k cached prefix + 16 new tokens.
#   python tests/gpu/prepare.py base attnvar
#   tests/gpu/carry.sh gpu/configs artifacts/qwen3-4b $(cd .cache && ls -d artifacts/qwen3-4b-attn-*)
#   (device) bash tests/gpu/call_attn_variants.sh $OUT
# VARIANTS / LENGTHS narrow it; ~20 s a profile.
. "$(dirname "$0")/call_start.sh" "$@"
# installs the package, makes the random qwen3-4b directory, re-renders qwen3-4b: the first profile
STAGES=profile PROFILE_ARGS="--steps prefix_hit,decode_b1 --isolate attention_cached,linear --reps 10" \
  bash tests/gpu/session.sh "$OUT/base-1024" > "$OUT/base-1024.log" 2>&1
grep -E "prefix_hit|decode_b1|attention_cached" "$OUT/base-1024.log" | head -12
vs=(${VARIANTS:-base $(cd .cache/artifacts && ls -d qwen3-4b-attn-* 2>/dev/null | sed 's/qwen3-4b-attn-//')})
python3 tests/gpu/rerender.py .cache/artifacts/qwen3-4b-attn-* 2>&1 | tail -8
for v in "${vs[@]}"; do
  art=.cache/artifacts/qwen3-4b-attn-$v
  [ "$v" = base ] && art=.cache/artifacts/qwen3-4b
  for L in ${LENGTHS:-1024 16384}; do
    [ "$v" = base ] && [ "$L" = 1024 ] && continue          # the first profile above
    mkdir -p "$OUT/$v-$L"
    echo "== $v, prefix $L"
    timeout 120 python3 -m infc.cli bench profile --artifact "$art" --model-path /tmp/infc-models/qwen3-4b \
      --steps prefix_hit --prefix-tokens "$L" --isolate attention_cached --reps 10 --no-bandwidth \
      --out "$OUT/$v-$L" > "$OUT/$v-$L.log" 2>&1
    grep -E "^prefix_hit|\| layer.3 \|" "$OUT/$v-$L.log" | head -3
  done
done
