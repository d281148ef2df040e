#!/usr/bin/env bash
# issue 46: a batch-1 LoRA site's look in the W stream (LORA_MID 1 at a half, a quarter, three quarters; LORA_MID 2
# with the parked ranges loaded there too, and with LORA_EARLY) against the base and the defaults (sets)
OUT=$1; mkdir -p $OUT; export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1 NCCL_NVLS_ENABLE=0
t0=$(date +%s); say() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a $OUT/log.txt; }
mv .cache/carry-*.tar .cache/carry.tar; bash tests/gpu/carry.sh --unpack
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl-b/*.whl > $OUT/wheels.log 2>&1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > $OUT/install.log 2>&1 || { cat $OUT/install.log; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee $OUT/gpu.txt
A=.cache/artifacts; C=.cache/gpu/configs
python3 tests/gpu/rerender.py $A/qwen3-4b $A/qwen3-4b-lora8r16 2>&1 | tail -3 | tee -a $OUT/log.txt
python3 tools/experiments/lora_site_probe.py rerender mid mid1 mid3 mid2 mid2-early 2>&1 | tail -5 | tee -a $OUT/log.txt
prof() {  # art loras steps tag
  [ $(( $(date +%s) - t0 )) -gt ${LIMIT:-500} ] && { say "skipped $1 $3 ($4): time"; return; }
  say "profile $1 loras $2 steps $3 ($4)"
  timeout 90 python3 -m infc.cli bench profile --artifact $A/$1 --model-path $C/qwen3-4b --load-format dummy --no-bandwidth \
    --loras $2 --reps 10 --steps $3 --mixed-decodes 32 --out /tmp/p-$4-$1 2>&1 \
    | grep -vE "Loading weights|it/s\]|^\s*$" | grep -E "^\| (decode|step)|GPU|wall|rror|Trace|line" | head -30 >> $OUT/log.txt
}
prof qwen3-4b 0 decode_b1_graph,decode_b1 b1
prof qwen3-4b-lora8r16 8 decode_b1_graph,decode_b1 b1
prof qwen3-4b-lora8r16-mid 8 decode_b1_graph,decode_b1 b1
prof qwen3-4b-lora8r16-mid1 8 decode_b1_graph b1
prof qwen3-4b-lora8r16-mid3 8 decode_b1_graph b1
prof qwen3-4b-lora8r16-mid2 8 decode_b1_graph,decode_b1 b1
prof qwen3-4b-lora8r16-mid2-early 8 decode_b1_graph b1
for r in r2 r3; do
prof qwen3-4b 0 decode_b1_graph $r
prof qwen3-4b-lora8r16 8 decode_b1_graph $r
prof qwen3-4b-lora8r16-mid 8 decode_b1_graph $r
prof qwen3-4b-lora8r16-mid1 8 decode_b1_graph $r
prof qwen3-4b-lora8r16-mid3 8 decode_b1_graph $r
prof qwen3-4b-lora8r16-mid2 8 decode_b1_graph $r
done
(cd /tmp && tar czf $OUT/profiles.tgz p-*)
say done
