#!/usr/bin/env bash
# Session #17, call B. Any card: issue 43's exactness on the trained model
# (test_self_draft_on_a_trained_model_is_exact: a self-draft through the decode and the verify
# program). H200 then: the verify forms (prepare.py verify-ab: old, pre, best, each naming every
# key, so the H200 renders the H100's measured kernels) against the plain build, `bench
# spec-verify` batch 1, k = 0 / 1 / 4, two rounds alternating; verify_b1 profile of best.
source tests/gpu/call_preamble.sh "$1"
A=.cache/artifacts; C=.cache/gpu/configs
python3 tests/gpu/rerender.py $A/skipgram $A/skipgram-narrow5 2>&1 | tail -2 | tee -a $OUT/log.txt
say "trained-model self-draft, both builds"
timeout 300 python3 -m pytest tests/gpu/test_spec_gpu.py -k trained_model -q -s -p no:cacheprovider 2>&1 \
  | tee $OUT/pytest-trained.log | grep -E "passed|failed|error|acceptance|trained|^E " | tail -30 | tee -a $OUT/log.txt
on_h200 || { say done; exit 0; }
V="old pre best"
python3 tests/gpu/rerender.py $A/qwen3-4b $(for v in $V; do echo $A/qwen3-4b-v5-$v; done) 2>&1 | tail -4 | tee -a $OUT/log.txt
sv() {
  [ $(( $(date +%s) - t0 )) -gt 480 ] && { say "skipped $1 $2: time"; return; }
  say "spec-verify $1 ($2)"
  timeout 60 python3 -m infc.cli bench spec-verify --artifact $A/$1 --model-path $C/qwen3-4b --load-format dummy \
    --batches 1 --drafts 0,1,4 --out /tmp/sv-$1-$2 2>&1 | grep -E "drafts|rror|Trace" | tail -4 | tee -a $OUT/log.txt
}
for r in r1 r2; do
  for v in $V; do sv qwen3-4b-v5-$v $r; done
  sv qwen3-4b $r
done
if [ $(( $(date +%s) - t0 )) -lt 520 ]; then
  say "profile best"
  timeout 45 python3 -m infc.cli bench profile --artifact $A/qwen3-4b-v5-best --model-path $C/qwen3-4b --load-format dummy --no-bandwidth \
    --reps 10 --steps decode_b1_graph,verify_b1 --verify-drafts 4 --out /tmp/p-best 2>&1 | grep -E "^\| [1-6] \||^verify|^decode|rror|Trace" | head -16 | tee -a $OUT/log.txt
fi
(cd /tmp && tar czf $OUT/runs.tgz sv-* p-* 2>/dev/null)
say done
