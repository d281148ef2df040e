#!/usr/bin/env bash
# The decode GEMVs' W prefetch under PDL (gemv.py.j2 PREFETCH_K; bench/NOTES.md) in one call on one
# GPU: batch-1 TPOT of qwen3-4b as built and of each prefetch variant (tests/gpu/prepare.py
# GEMV_PREFETCH), in alternating rounds, then a per-launch profile of batch-1 decode for the base and
# VARIANT_PROFILE, and the same-bits check (tests/gpu/same_tokens.py) of every variant against the base.
#   python tests/gpu/prepare.py base gemvpf
#   tests/gpu/carry.sh gpu/configs artifacts/qwen3-4b $(cd .cache && ls -d artifacts/qwen3-4b-gemv-*)
#   (device) bash tests/gpu/call_gemv_prefetch.sh $OUT
set -uo pipefail
OUT=${1:?OUT}
cd "$(dirname "$0")/../.."
bash tests/gpu/carry.sh --unpack
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
M=/tmp/infc-models/qwen3-4b
# installs the package, makes the random qwen3-4b directory, re-renders qwen3-4b; the first round's base
STAGES=latency LATENCY_ARGS="--no-hf --prompts ${PROMPTS:-32,1024}" bash tests/gpu/session.sh "$OUT/base-1" > "$OUT/base-1.log" 2>&1
grep -E "infc prompt" "$OUT/base-1.log"
vs=(${VARIANTS:-$(cd .cache/artifacts && ls -d qwen3-4b-gemv-* 2>/dev/null | sed 's/qwen3-4b-gemv-//')})
python3 tests/gpu/rerender.py .cache/artifacts/qwen3-4b-gemv-* 2>&1 | tail -4
art() { [ "$1" = base ] && echo .cache/artifacts/qwen3-4b || echo ".cache/artifacts/qwen3-4b-gemv-$1"; }
for round in $(seq 1 ${ROUNDS:-2}); do
  for v in base "${vs[@]}"; do
    [ "$v" = base ] && [ "$round" = 1 ] && continue
    mkdir -p "$OUT/$v-$round"
    echo "== $v, round $round"
    timeout 150 python3 -m infc.cli bench latency --artifact "$(art $v)" --model-path $M --no-hf \
      --prompts "${PROMPTS:-32,1024}" --out "$OUT/$v-$round" > "$OUT/$v-$round.log" 2>&1
    grep -E "infc prompt" "$OUT/$v-$round.log"
  done
done
for v in base ${VARIANT_PROFILE:-pfall}; do
  echo "== profile $v"
  timeout 120 python3 -m infc.cli bench profile --artifact "$(art $v)" --model-path $M --steps decode_b1 \
    --reps 10 --out "$OUT/profile-$v" > "$OUT/profile-$v.log" 2>&1
  grep -E "^decode_b1|\| layer\.[0-9] \| linear" "$OUT/profile-$v.log" | head -6
done
for v in "${vs[@]}"; do
  echo "== same bits: $v"
  timeout 150 python3 tests/gpu/same_tokens.py .cache/artifacts/qwen3-4b "$(art $v)" $M 2>&1 | tail -4
done
