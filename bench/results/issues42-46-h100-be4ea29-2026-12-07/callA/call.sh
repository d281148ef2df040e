#!/usr/bin/env bash
# issue 46: qwen3-4b base vs LoRA builds at decode_b1_graph: the schedules (first, both, parts) and probes
# (p3, p1, p2); issue 42: qwen3-4b-fp8 against the build without act_codes (the narrow norms merged into
# the GEMVs); issue 46: decode_wide at 32 decodes for base, lora, first, split.
OUT=$1; mkdir -p $OUT; export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1 NCCL_NVLS_ENABLE=0
t0=$(date +%s); say() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a $OUT/log.txt; }
mv .cache/carry-*.tar .cache/carry.tar; bash tests/gpu/carry.sh --unpack
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl-b/*.whl > $OUT/wheels.log 2>&1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > $OUT/install.log 2>&1 || { cat $OUT/install.log; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee $OUT/gpu.txt
A=.cache/artifacts; C=.cache/gpu/configs
python3 tests/gpu/rerender.py $A/qwen3-4b $A/qwen3-4b-lora8r16 $A/qwen3-4b-lora8r16-split $A/qwen3-4b-fp8 $A/qwen3-4b-fp8-merge $A/qwen3-4b-fp8-noac 2>&1 | tail -6 | tee -a $OUT/log.txt
python3 tools/experiments/lora_site_probe.py rerender 2>&1 | tail -6 | tee -a $OUT/log.txt
prof() {  # art loras steps tag model
  [ $(( $(date +%s) - t0 )) -gt ${LIMIT:-490} ] && { say "skipped $1 $3 ($4): time"; return; }
  say "profile $1 loras $2 steps $3 ($4)"
  timeout 90 python3 -m infc.cli bench profile --artifact $A/$1 --model-path $C/${5:-qwen3-4b} --load-format dummy --no-bandwidth \
    --loras $2 --reps 10 --steps $3 --mixed-decodes 32 --out $OUT/p-$4-$1 2>&1 \
    | grep -vE "Loading weights|it/s\]|^\s*$" | grep -E "^\| (decode|step)|GPU|wall|rror|Trace|line" | head -30 >> $OUT/log.txt
}
prof qwen3-4b 0 decode_b1_graph b1
prof qwen3-4b-lora8r16 8 decode_b1_graph b1
prof qwen3-4b-lora8r16-first 8 decode_b1_graph b1
prof qwen3-4b-lora8r16-both 8 decode_b1_graph b1
prof qwen3-4b-lora8r16-parts 8 decode_b1_graph b1
prof qwen3-4b-fp8 0 decode_b1,decode_b1_graph f8 qwen3-4b-fp8
prof qwen3-4b-fp8-merge 0 decode_b1,decode_b1_graph f8 qwen3-4b-fp8
prof qwen3-4b-fp8-noac 0 decode_b1,decode_b1_graph f8 qwen3-4b-fp8
prof qwen3-4b-fp8 0 decode_b1_graph f8r2 qwen3-4b-fp8
prof qwen3-4b-fp8-merge 0 decode_b1_graph f8r2 qwen3-4b-fp8
prof qwen3-4b 0 decode_b1_graph b1r2
prof qwen3-4b-lora8r16 8 decode_b1_graph b1r2
prof qwen3-4b-lora8r16-both 8 decode_b1_graph b1r2
prof qwen3-4b-lora8r16-p3 8 decode_b1_graph b1
prof qwen3-4b-lora8r16-p1 8 decode_b1_graph b1
[ $(( $(date +%s) - t0 )) -lt 420 ] && prof qwen3-4b-lora8r16 8 decode_wide w
[ $(( $(date +%s) - t0 )) -lt 450 ] && prof qwen3-4b-lora8r16-split 8 decode_wide w
[ $(( $(date +%s) - t0 )) -lt 480 ] && prof qwen3-4b 0 decode_wide w
[ $(( $(date +%s) - t0 )) -lt 500 ] && prof qwen3-4b-lora8r16-p2 8 decode_b1_graph b1
say done
