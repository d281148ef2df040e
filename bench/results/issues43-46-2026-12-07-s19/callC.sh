#!/usr/bin/env bash
# Session #19 call C (either card): issue 43's verify table for its second model, qwen3-8b as the
# committed tables render it (prepare.py verify-8b: on the H200 table the template's VERIFY_DOT
# form, on the H100's too since its verify entries are qwen3-4b's shapes): `bench spec-verify` at
# batches 1, 8, 32 and k = 0..7, then batch 1 at k = 0 and 4 twice more. Copied to the root to run.
# (no git checkout: the device copy's git metadata is stale, HEAD an older commit)
source tests/gpu/run.sh --preamble "$1"
A=.cache/artifacts; C=.cache/gpu/configs
python3 tests/gpu/rerender.py $A/qwen3-8b-v5 2>&1 | tail -2 | tee -a $OUT/log.txt
sv() {
  [ $(( $(date +%s) - t0 )) -gt $2 ] && { say "skipped $1: time"; return; }
  say "spec-verify qwen3-8b-v5 ($1)"
  timeout 200 python3 -m infc.cli bench spec-verify --artifact $A/qwen3-8b-v5 --model-path $C/qwen3-8b --load-format dummy \
    "${@:3}" --out /tmp/sv-8b-$1 2>&1 | grep -E "drafts|batch|rror|Trace" | tail -30 | tee -a $OUT/log.txt
}
sv table 250 --batches 1,8,32 --drafts 0,1,2,3,4,5,6,7
sv r2 450 --batches 1 --drafts 0,4
sv r3 500 --batches 1 --drafts 0,4
(cd /tmp && tar czf $OUT/runs.tgz sv-* 2>/dev/null)
say done
