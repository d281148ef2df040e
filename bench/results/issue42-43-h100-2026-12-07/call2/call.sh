#!/usr/bin/env bash
# issue 43: the verify GEMVs' forms (tests/gpu/prepare.py verify-ab: old, rows, rowsq, probe, pre), `bench spec-verify`
# at batch 1, drafts 0 / 1 / 4, alternating two rounds; then `bench profile` decode_b1_graph + verify_b1 of old and probe.
OUT=$1; mkdir -p $OUT; export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1 NCCL_NVLS_ENABLE=0
t0=$(date +%s); say() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a $OUT/log.txt; }
bash tests/gpu/carry.sh --unpack
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl-b/*.whl > $OUT/wheels.log 2>&1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > $OUT/install.log 2>&1 || { cat $OUT/install.log; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee $OUT/gpu.txt
A=.cache/artifacts; C=.cache/gpu/configs/qwen3-4b
python3 tests/gpu/rerender.py $A/qwen3-4b-v5-old $A/qwen3-4b-v5-rows $A/qwen3-4b-v5-rowsq $A/qwen3-4b-v5-probe $A/qwen3-4b-v5-pre 2>&1 | tail -5 | tee -a $OUT/log.txt
sv() {  # form round
  [ $(( $(date +%s) - t0 )) -gt ${LIMIT:-400} ] && { say "skipped $1 $2: time"; return; }
  say "spec-verify $1 ($2)"
  timeout 90 python3 -m infc.cli bench spec-verify --artifact $A/qwen3-4b-v5-$1 --model-path $C --load-format dummy \
    --batches 1 --drafts 0,1,4 --out /tmp/sv-$1-$2 2>&1 | grep -vE "Loading|it/s\]|^\s*$" | tail -6 >> $OUT/log.txt
}
for f in old rows rowsq probe pre; do sv $f r1; done
for f in pre probe rowsq rows old; do sv $f r2; done
for f in old pre; do
  [ $(( $(date +%s) - t0 )) -gt 450 ] && break
  say "profile $f"
  timeout 60 python3 -m infc.cli bench profile --artifact $A/qwen3-4b-v5-$f --model-path $C --load-format dummy --no-bandwidth \
    --reps 10 --steps decode_b1_graph,verify_b1 --verify-drafts 4 --out /tmp/p-$f 2>&1 | grep -E "^\| [0-9]+ \||^decode|^verify|rror|Trace" | head -14 >> $OUT/log.txt
done
(cd /tmp && tar czf $OUT/runs.tgz sv-* p-* 2>/dev/null)
say done
