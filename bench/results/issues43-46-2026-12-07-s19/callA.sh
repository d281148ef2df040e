#!/usr/bin/env bash
# Session #19 call A (#18's, the H100 branch with prepare.py verify-ab's n16 forms), branching on the card (kind nvidia-h200 lands either). H200: issue 46's
# acceptance run, session #16's H200 branch (1024/128 throughput at 1, 32, 256 concurrent of
# qwen3-4b and of qwen3-4b --enable-lora with 8 rank-16 adapters in turn, dummy weights, two rounds
# alternating; then the LoRA golden gate against HF + PEFT). H100: issue 43's grid A/B
# (session #17's callE: qwen3-4b-v5-best, GRID "max", against -best-paths, GRID "paths", and
# prepare.py verify-ab's n16 / n16u, `bench spec-verify` batches 1 and 32 at k = 0 and 4, two
# rounds in mirrored order), then plain serving's
# (qwen3-4b against qwen3-4b-paths, prepare.py grid-ab: 1024/128 throughput at 256 concurrent, A B B A
# as time allows). Copied to the repository root to run.
# the committed tree only (the build machine's uncommitted edits do not travel)
# (#19: this line ran, and put back the device copy's stale HEAD, cede78c0, for compiler, runtime, infc, server and codegen_templates: the LoRA runs used cede78c0's runtime and server with the kernels carried from 0a9322d1; removed from calls B-E)
# git checkout -q HEAD -- compiler runtime infc server codegen_templates   (ran in #19; off for any rerun)
source tests/gpu/run.sh --preamble "$1"
END=${2:-575}    # the second the call's work must end by (the device time left, less the start)
A=.cache/artifacts; C=.cache/gpu/configs
if on_h200; then
  python3 tests/gpu/rerender.py $A/qwen3-4b $A/qwen3-4b-lora8r16 2>&1 | tail -2 | tee -a $OUT/log.txt
  M=$(cd tests/gpu && python3 -c "import models; print(models.model_dir('qwen3-4b'))" 2>>$OUT/log.txt | tail -1)
  mods=""
  for i in 1 2 3 4 5 6 7 8; do
    python3 tools/make_lora_adapter.py --model $M --out /tmp/infc-adapters/r16-$i --rank 16 --alpha 32 --seed $i --dtype bf16 >/dev/null
    mods="$mods a$i=/tmp/infc-adapters/r16-$i"
  done
  say "model and adapters"
  tp() {
    [ $(( $(date +%s) - t0 )) -gt $((END - 175)) ] && { say "skipped $1: time"; return; }
    say "throughput $1"
    timeout 150 python3 -m infc.cli bench throughput --model-path $M --load-format dummy --concurrency 1,32,256 \
      --out /tmp/t-$1 "${@:2}" 2>&1 | grep -vE "it/s\]" | grep -E "concurrency|tok/s|TPOT|rror|Trace" | tail -8 | tee -a $OUT/log.txt
  }
  L="--enable-lora --max-loras 8 --max-lora-rank 16 --lora-modules $mods"
  tp lora8-r1 $L
  tp base-r1
  tp lora8-r2 $L
  tp base-r2
  (cd /tmp && tar czf $OUT/results.tgz t-*)
  left=$(( END - ($(date +%s) - t0) ))
  say "lora gate ($left s left)"
  [ $left -gt 60 ] && timeout $left python3 -m pytest tests/gpu/test_lora_gpu.py -q -s -p no:cacheprovider 2>&1 \
    | tee $OUT/pytest-lora.log | grep -E "passed|failed|error|regret|p99|^E " | tail -30 | tee -a $OUT/log.txt
else
  python3 tests/gpu/rerender.py $A/qwen3-4b-v5-best $A/qwen3-4b-v5-best-paths $A/qwen3-4b-v5-n16 $A/qwen3-4b-v5-n16u 2>&1 | tail -2 | tee -a $OUT/log.txt
  sv() {
    [ $(( $(date +%s) - t0 )) -gt $((END - 260)) ] && { say "skipped $1 $2: time"; return; }
    say "spec-verify $1 ($2)"
    timeout 110 python3 -m infc.cli bench spec-verify --artifact $A/$1 --model-path $C/qwen3-4b --load-format dummy \
      --batches 1,32 --drafts 0,4 --out /tmp/sv-$1-$2 2>&1 | grep -E "drafts|batch|rror|Trace" | tail -6 | tee -a $OUT/log.txt
  }
  for v in best best-paths n16 n16u; do sv qwen3-4b-v5-$v r1; done
  for v in n16u n16 best-paths best; do sv qwen3-4b-v5-$v r2; done
  python3 tests/gpu/rerender.py $A/qwen3-4b $A/qwen3-4b-paths 2>&1 | tail -2 | tee -a $OUT/log.txt
  tp() {
    [ $(( $(date +%s) - t0 )) -gt $((END - 100)) ] && { say "skipped $1 $2: time"; return; }
    say "throughput $1 ($2)"
    timeout 100 python3 -m infc.cli bench throughput --artifact $A/$1 --model-path $C/qwen3-4b --load-format dummy \
      --concurrency 256 --out /tmp/tp-$1-$2 2>&1 | grep -vE "it/s\]" | grep -E "concurrency|tok/s|rror|Trace" | tail -4 | tee -a $OUT/log.txt
  }
  tp qwen3-4b r1
  tp qwen3-4b-paths r1
  tp qwen3-4b-paths r2
  tp qwen3-4b r2
  (cd /tmp && tar czf $OUT/runs.tgz sv-* tp-* 2>/dev/null)
fi
say done
