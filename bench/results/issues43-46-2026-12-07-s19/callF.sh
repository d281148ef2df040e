#!/usr/bin/env bash
# Session #19 call F, prepared and not run: issue 43's end-to-end batch-1 points on an H200 with
# random weights at acceptance rates set by construction (`bench spec-e2e`: the verdict rewritten,
# every step's cost real): qwen3-8b drafted by qwen3-0.6b (prepare.py draft-8b), qwen3-4b's
# self-draft (the ceiling) and an EAGLE-3 head at qwen3-4b's shapes (prepare.py eagle3), k = 4,
# rates 1 / 0.8 / 0.6; the plain builds (what serving runs), then qwen3-8b's verify program
# (INFC_VERIFY_PROGRAM=1: qwen3-8b-narrow5).
# Prepare: tests/gpu/prepare.py base draft-8b eagle3; carry .whl-b, gpu/configs, artifacts/qwen3-8b,
# artifacts/qwen3-8b-narrow5, artifacts/qwen3-0.6b, artifacts/qwen3-4b, artifacts/qwen3-4b-eagle3-2-18-33,
# artifacts/eagle3-qwen3-4b-eagle3 (tests/gpu/carry.sh), and this script copied to the root.
source tests/gpu/run.sh --preamble "$1"
END=${2:-560}
C=$PWD/.cache/gpu/configs
e2e() {
  [ $(( $(date +%s) - t0 )) -gt $((END - 120)) ] && { say "skipped $1: time"; return; }
  say "spec-e2e $1"
  timeout 150 env ${3:-} python3 -m infc.cli bench spec-e2e --model-path $C/$2 --load-format dummy --device cuda \
    --accept 1,0.8,0.6 --max-tokens 128 --speculative-config "$4" --out /tmp/e2e-$1 2>&1 \
    | grep -E "plain|accept|rror|Trace" | tail -6 | tee -a $OUT/log.txt
}
e2e 8b-draft06 qwen3-8b "" '{"method": "draft_model", "model": "'$C'/qwen3-0.6b", "num_speculative_tokens": 4}'
e2e 4b-self qwen3-4b "" '{"method": "draft_model", "model": "'$C'/qwen3-4b", "num_speculative_tokens": 4}'
e2e 4b-eagle3 qwen3-4b "" '{"method": "eagle3", "model": "'$C'/eagle3-qwen3-4b", "num_speculative_tokens": 4}'
e2e 8b-draft06-vp qwen3-8b INFC_VERIFY_PROGRAM=1 '{"method": "draft_model", "model": "'$C'/qwen3-0.6b", "num_speculative_tokens": 4}'
(cd /tmp && tar czf $OUT/runs.tgz e2e-* 2>/dev/null)
say done
