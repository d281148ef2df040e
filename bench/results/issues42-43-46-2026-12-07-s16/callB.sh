#!/usr/bin/env bash
# H200: issue 46's acceptance (callA's branch). H100: issue 43's exactness on one machine: the
# draft-model test on the plain build, then through the verify program, then the acceptance probe
# (greedy and sampled rows apart) on each.
OUT=$1; mkdir -p $OUT; export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1 NCCL_NVLS_ENABLE=0
t0=$(date +%s); say() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a $OUT/log.txt; }
if nvidia-smi --query-gpu=name --format=csv | grep -q H200; then exec bash callA.sh $OUT; fi
bash tests/gpu/carry.sh --unpack
[ -d /tmp/site/fastapi ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl-b/*.whl > $OUT/wheels.log 2>&1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > $OUT/install.log 2>&1 || { cat $OUT/install.log; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee $OUT/gpu.txt
git log --oneline -1 | tee -a $OUT/log.txt
A=.cache/artifacts
python3 tests/gpu/rerender.py $A/qwen3-4b $A/qwen3-4b-narrow5 $A/qwen3-4b-l2 2>&1 | tail -3 | tee -a $OUT/log.txt
for v in 0 1 0 1; do
  say "draft-model test, INFC_VERIFY_PROGRAM=$v"
  INFC_VERIFY_PROGRAM=$v timeout 150 python3 -m pytest tests/gpu/test_spec_gpu.py -k draft_model -q -s -p no:cacheprovider 2>&1 \
    | tee -a $OUT/pytest-draft-$v.log | grep -E "passed|failed|acceptance|k=|Differing|^E .*r[0-9]" | tail -16 | tee -a $OUT/log.txt
  say "probe, INFC_VERIFY_PROGRAM=$v"
  INFC_VERIFY_PROGRAM=$v timeout 90 python3 accept_probe.py 2>&1 | grep -vE "it/s\]" | tail -5 | tee -a $OUT/log.txt
done
say done
