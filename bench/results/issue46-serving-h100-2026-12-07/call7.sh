#!/usr/bin/env bash
# issue 46: the LoRA golden gate (tests/gpu/test_lora_gpu.py: HF + PEFT, 4 adapters and the base, eager batch 1
# and graphs at batch 5) at this tree
OUT=$1; mkdir -p $OUT; export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1 NCCL_NVLS_ENABLE=0
t0=$(date +%s); say() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a $OUT/log.txt; }
bash tests/gpu/carry.sh --unpack
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl-b/*.whl > $OUT/wheels.log 2>&1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > $OUT/install.log 2>&1 || { cat $OUT/install.log; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee $OUT/gpu.txt
A=.cache/artifacts
python3 tests/gpu/rerender.py $A/qwen3-4b $A/qwen3-4b-lora8r16 2>&1 | tail -2 | tee -a $OUT/log.txt
say "lora gate"
timeout 400 python3 -m pytest tests/gpu/test_lora_gpu.py -q -s -p no:cacheprovider 2>&1 \
  | tee $OUT/pytest-lora.log | grep -E "passed|failed|error|regret|^E " | tail -20 | tee -a $OUT/log.txt
say done
