#!/usr/bin/env bash
# A tuning-table change A/B on one GPU in one call: `bench throughput` (and optionally `bench
# latency --no-hf`) of qwen3-4b with the table as committed against BASE_TABLE (the table before
# the change), in alternating rounds. The artifact must hold both tables' cubins (build it with
# each table into the same .cache/artifacts/qwen3-4b), so nothing compiles here.
#   BASE_TABLE=.cache/tuning-base/h200.json bash tests/gpu/call_table_ab.sh $OUT
# CONCURRENCY (64,256), ROUNDS (2), LATENCY (0: skip; 1: bench latency --no-hf too).
. "$(dirname "$0")/call_start.sh" "$@"
BASE_TABLE=${BASE_TABLE:?BASE_TABLE}
gpu=$(basename "$BASE_TABLE" .json)
cp "codegen_templates/tuning/$gpu.json" /tmp/table-new.json
# installs the package, makes the random qwen3-4b directory
STAGES=generate bash tests/gpu/session.sh "$OUT/setup" > "$OUT/setup.log" 2>&1
tail -3 "$OUT/setup.log"
M=/tmp/infc-models/qwen3-4b
for round in $(seq 1 ${ROUNDS:-2}); do
  for side in base new; do
    if [ $side = base ]; then cp "$BASE_TABLE" "codegen_templates/tuning/$gpu.json"
    else cp /tmp/table-new.json "codegen_templates/tuning/$gpu.json"; fi
    d="$OUT/$side-$round"; mkdir -p "$d"
    echo "== $side, round $round"
    timeout 240 python3 -m infc.cli bench throughput --model-path $M --concurrency "${CONCURRENCY:-64,256}" \
      --out "$d" > "$d/throughput.log" 2>&1
    grep -E "compile|^concurrency" "$d/throughput.log"
    if [ "${LATENCY:-0}" = 1 ]; then
      python3 tests/gpu/rerender.py .cache/artifacts/qwen3-4b 2>&1 | tail -1
      timeout 150 python3 -m infc.cli bench latency --artifact .cache/artifacts/qwen3-4b --model-path $M \
        --no-hf --out "$d" > "$d/latency.log" 2>&1
      grep -E "infc prompt" "$d/latency.log"
    fi
  done
done
cp /tmp/table-new.json "codegen_templates/tuning/$gpu.json"
