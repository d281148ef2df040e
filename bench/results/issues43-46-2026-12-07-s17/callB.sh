#!/usr/bin/env bash
# Session #17, call B. Any card: issue 43's exactness on the trained model
# (test_self_draft_on_a_trained_model_is_exact: a self-draft through the decode and the verify
# program). H200 then: session #16's callD.sh (the verify forms against the plain build).
source tests/gpu/run.sh --preamble "$1"
A=.cache/artifacts; C=.cache/gpu/configs
python3 tests/gpu/rerender.py $A/skipgram $A/skipgram-narrow5 2>&1 | tail -2 | tee -a $OUT/log.txt
say "trained-model self-draft, both builds"
timeout 300 python3 -m pytest tests/gpu/test_spec_gpu.py -k trained_model -q -s -p no:cacheprovider 2>&1 \
  | tee $OUT/pytest-trained.log | grep -E "passed|failed|error|acceptance|trained|^E " | tail -30 | tee -a $OUT/log.txt
say done
# then, on an H200, session #16's verify forms (its callD.sh: old, pre, best against the plain build)
on_h200 && exec bash bench/results/issues42-43-46-2026-12-07-s16/callD.sh "$OUT/verify-forms"
