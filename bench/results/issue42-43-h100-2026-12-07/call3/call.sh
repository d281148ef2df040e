#!/usr/bin/env bash
# issue 43, call 3: one launch changed at a time from the "pre" verify form (tests/gpu/prepare.py verify-ab),
# `bench spec-verify` batch 1, drafts 0 / 4, two rounds alternating; `bench profile` verify_b1 of each.
OUT=$1; mkdir -p $OUT; export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1 NCCL_NVLS_ENABLE=0
t0=$(date +%s); say() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a $OUT/log.txt; }
bash tests/gpu/carry.sh --unpack
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl-b/*.whl > $OUT/wheels.log 2>&1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > $OUT/install.log 2>&1 || { cat $OUT/install.log; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee $OUT/gpu.txt
A=.cache/artifacts; C=.cache/gpu/configs/qwen3-4b
V="pre gu-s1 gu-s4 gu-k64 gu-lanes q-s8 q-k64 o-s4 d-s4"
python3 tests/gpu/rerender.py $(for v in $V; do echo $A/qwen3-4b-v5-$v; done) 2>&1 | tail -9 | tee -a $OUT/log.txt
sv() {
  [ $(( $(date +%s) - t0 )) -gt 300 ] && { say "skipped $1 $2: time"; return; }
  say "spec-verify $1 ($2)"
  timeout 60 python3 -m infc.cli bench spec-verify --artifact $A/qwen3-4b-v5-$1 --model-path $C --load-format dummy \
    --batches 1 --drafts 0,4 --out /tmp/sv-$1-$2 2>&1 | grep -E "drafts|rror|Trace" | tail -4 >> $OUT/log.txt
}
for v in $V; do sv $v r1; done
for v in $(echo $V | tr ' ' '\n' | tac); do sv $v r2; done
for v in $V; do
  [ $(( $(date +%s) - t0 )) -gt 340 ] && break
  say "profile $v"
  timeout 45 python3 -m infc.cli bench profile --artifact $A/qwen3-4b-v5-$v --model-path $C --load-format dummy --no-bandwidth \
    --reps 10 --steps verify_b1 --verify-drafts 4 --out /tmp/p-$v 2>&1 | grep -E "^\| [1-5] \||^verify|rror|Trace" | head -7 >> $OUT/log.txt
done
(cd /tmp && tar czf $OUT/runs.tgz sv-* p-* 2>/dev/null)
say done
