#!/usr/bin/env bash
# Session #19 call E, prepared and not run (the session's device time ran out); for the next H200.
# Issue 43, qwen3-4b's verify cost at batch 1 (VERIFY_DOT measured 1.51-1.52x in call B):
# 1. `bench spec-verify` batch 1, k = 0 / 4 of the table as committed (v5-default), the same with
#    GRID "paths" (v5-default-paths), and the plain build (qwen3-4b: a verify step's rows on the
#    decode program, what serving runs without INFC_VERIFY_PROGRAM=1), mirrored rounds;
# 2. `infc tune run` of the verify launches (5 rows: gemv, gemv_gated, lm_head_last; the H200 table
#    has none), the build with the winners laid over the table on this machine (v5-tuned), and
#    its spec-verify beside v5-default, mirrored.
# Usage: bash callE.sh OUT [END] (END: the second the work must end by)
source tests/gpu/run.sh --preamble "$1"
END=${2:-560}
A=.cache/artifacts; C=.cache/gpu/configs
python3 tests/gpu/rerender.py $A/qwen3-4b-v5-default $A/qwen3-4b-v5-default-paths $A/qwen3-4b 2>&1 | tail -3 | tee -a $OUT/log.txt
sv() {
  [ $(( $(date +%s) - t0 )) -gt $((END - 40)) ] && { say "skipped $1 $2: time"; return; }
  say "spec-verify $1 ($2)"
  timeout 40 python3 -m infc.cli bench spec-verify --artifact $A/$1 --model-path $C/qwen3-4b --load-format dummy \
    --batches 1 --drafts 0,4 --out /tmp/sv-$1-$2 2>&1 | grep -E "drafts|batch|rror|Trace" | tail -4 | tee -a $OUT/log.txt
}
sv qwen3-4b-v5-default r1; sv qwen3-4b-v5-default-paths r1; sv qwen3-4b r1
sv qwen3-4b r2; sv qwen3-4b-v5-default-paths r2; sv qwen3-4b-v5-default r2
d=qwen3-4b-verify5-h200
if [ $(( $(date +%s) - t0 )) -lt $((END - 200)) ]; then
  say "tune run $d"
  mkdir -p $OUT/$d
  timeout 100 python3 -m infc.cli tune run --dir .cache/tune/$d --results-dir $OUT/$d --write $OUT/$d/h200.json \
    > $OUT/$d.log 2>&1; tail -25 $OUT/$d.log
  say "the build with the new entries"
  python3 - "$OUT/$d/h200.json" <<'PY' 2>&1 | tail -3 | tee -a $OUT/log.txt
import json, sys
from pathlib import Path
from infc.compiler.build import build
p = Path(sys.argv[1])
overlay = json.loads(p.read_text()).get("templates", {}) if p.exists() else {}
print({k: len(v) for k, v in overlay.items()})
build(out=".cache/artifacts/qwen3-4b-v5-tuned", gpu="h200", log=None, model_dir=".cache/gpu/configs/qwen3-4b",
      narrow_tokens=5, check_checkpoint=False, tuning_overlay=overlay)
print("built")
PY
  sv qwen3-4b-v5-tuned r1; sv qwen3-4b-v5-default r3; sv qwen3-4b-v5-tuned r2
fi
(cd /tmp && tar czf $OUT/runs.tgz sv-* 2>/dev/null)
say done
