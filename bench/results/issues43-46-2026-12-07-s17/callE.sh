#!/usr/bin/env bash
# Session #17 call E (any card): issue 43's grid A/B:
# qwen3-4b-v5-best (each GEMV's grid the wider path's blocks, GRID "max", the default) against
# -best-paths (the taken path's blocks, GRID "paths", in the verify and the decode programs),
# `bench spec-verify` batches 1 and 32, k = 0 and 4, A B B A.
source tests/gpu/run.sh --preamble "$1"
A=.cache/artifacts; C=.cache/gpu/configs
python3 tests/gpu/rerender.py $A/qwen3-4b-v5-best $A/qwen3-4b-v5-best-paths 2>&1 | tail -2 | tee -a $OUT/log.txt
sv() {
  [ $(( $(date +%s) - t0 )) -gt 330 ] && { say "skipped $1 $2: time"; return; }
  say "spec-verify $1 ($2)"
  timeout 100 python3 -m infc.cli bench spec-verify --artifact $A/$1 --model-path $C/qwen3-4b --load-format dummy \
    --batches 1,32 --drafts 0,4 --out /tmp/sv-$1-$2 2>&1 | grep -E "drafts|batch|rror|Trace" | tail -6 | tee -a $OUT/log.txt
}
sv qwen3-4b-v5-best r1
sv qwen3-4b-v5-best-paths r1
sv qwen3-4b-v5-best-paths r2
sv qwen3-4b-v5-best r2
(cd /tmp && tar czf $OUT/runs.tgz sv-* 2>/dev/null)
say done
