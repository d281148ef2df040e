#!/usr/bin/env bash
# Session #19 call B, branching on the card. H200: issue 43's verify cost on qwen3-4b as the
# template now renders it on the H200 table (VERIFY_DOT; prepare.py verify-ab's v5-default):
# `bench spec-verify` at batches 1, 8, 32 and k = 0..7, then the A/B at batch 1, k = 0 and 4
# against the CUDA-core rows it replaced (v5-lanes: FMA_T "rows") and verify-ab's n16 / n16u
# (16-row W blocks, fewer K splits), in mirrored order. H100: the GPU gates on the default build (golden gates of qwen3-4b,
# llama-3.2-1b, tiny-moe and qwen3-4b --no-fuse against HF bf16, the engine tests, no torch), and
# the trained model's self-draft through both builds (prepare.py draft's skipgram-narrow5).
# Copied to the repository root to run.
# the committed tree only (the build machine's uncommitted edits do not travel)
# (no git checkout: the device copy's git metadata is stale, HEAD an older commit)
source tests/gpu/run.sh --preamble "$1"
A=.cache/artifacts; C=.cache/gpu/configs
if on_h200; then
  python3 tests/gpu/rerender.py $A/qwen3-4b-v5-default $A/qwen3-4b-v5-lanes $A/qwen3-4b-v5-n16 $A/qwen3-4b-v5-n16u 2>&1 | tail -2 | tee -a $OUT/log.txt
  sv() {
    [ $(( $(date +%s) - t0 )) -gt $3 ] && { say "skipped $1 $2: time"; return; }
    say "spec-verify $1 ($2)"
    timeout 150 python3 -m infc.cli bench spec-verify --artifact $A/$1 --model-path $C/qwen3-4b --load-format dummy \
      "${@:4}" --out /tmp/sv-$1-$2 2>&1 | grep -E "drafts|batch|rror|Trace" | tail -30 | tee -a $OUT/log.txt
  }
  sv qwen3-4b-v5-default table 200 --batches 1,8,32 --drafts 0,1,2,3,4,5,6,7
  for v in lanes n16 n16u; do sv qwen3-4b-v5-$v r1 480 --batches 1 --drafts 0,4; done
  for v in n16u n16 default lanes; do sv qwen3-4b-v5-$v r2 520 --batches 1 --drafts 0,4; done
  (cd /tmp && tar czf $OUT/runs.tgz sv-* 2>/dev/null)
else
  INFC_GPU_FAMILIES=none SUITE_S=470 SUITE_PATHS="tests/gpu/test_golden.py tests/gpu/test_engine_gpu.py tests/gpu/test_no_torch.py tests/gpu/test_spec_gpu.py::test_self_draft_on_a_trained_model_is_exact" \
    bash tests/gpu/run.sh $OUT/gates suite 2>&1 | tail -40 | tee -a $OUT/log.txt
fi
say done
