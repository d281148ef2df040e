#!/usr/bin/env bash
# H200: issue 43's verify forms (tests/gpu/prepare.py verify-ab: old, pre, best, each naming every key,
# so the H200 renders the H100's measured kernels) against the plain build, `bench spec-verify` batch 1,
# k = 0 / 1 / 4, two rounds alternating; verify_b1 profile of best. H100: callB's exactness runs.
OUT=$1; mkdir -p $OUT; export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1 NCCL_NVLS_ENABLE=0
t0=$(date +%s); say() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a $OUT/log.txt; }
if ! nvidia-smi --query-gpu=name --format=csv | grep -q H200; then exec bash callB.sh $OUT; fi
bash tests/gpu/carry.sh --unpack
[ -d /tmp/site/fastapi ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl-b/*.whl > $OUT/wheels.log 2>&1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > $OUT/install.log 2>&1 || { cat $OUT/install.log; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee $OUT/gpu.txt
git log --oneline -1 | tee -a $OUT/log.txt
A=.cache/artifacts; C=.cache/gpu/configs
V="old pre best"
python3 tests/gpu/rerender.py $A/qwen3-4b $(for v in $V; do echo $A/qwen3-4b-v5-$v; done) 2>&1 | tail -4 | tee -a $OUT/log.txt
sv() {
  say "spec-verify $1 ($2)"
  timeout 60 python3 -m infc.cli bench spec-verify --artifact $A/$1 --model-path $C/qwen3-4b --load-format dummy \
    --batches 1 --drafts 0,1,4 --out /tmp/sv-$1-$2 2>&1 | grep -E "drafts|rror|Trace" | tail -4 | tee -a $OUT/log.txt
}
for r in r1 r2; do
  for v in $V; do sv qwen3-4b-v5-$v $r; done
  sv qwen3-4b $r
done
say "profile best"
timeout 45 python3 -m infc.cli bench profile --artifact $A/qwen3-4b-v5-best --model-path $C/qwen3-4b --load-format dummy --no-bandwidth \
  --reps 10 --steps decode_b1_graph,verify_b1 --verify-drafts 4 --out /tmp/p-best 2>&1 | grep -E "^\| [1-6] \||^verify|^decode|rror|Trace" | head -16 | tee -a $OUT/log.txt
(cd /tmp && tar czf $OUT/runs.tgz sv-* p-* 2>/dev/null)
say done
