#!/usr/bin/env bash
# issue 42: qwen3-4b-fp8's narrow GEMVs at 32 x 256 W tiles (-n32: every GEMV; -gu32: gate|up alone) against the
# default, decode_b1 eager per launch and decode_b1 graph, two rounds. Build: .venv/bin/python tests/gpu/prepare.py
# fp8-ab; tests/gpu/carry.sh --with .whl-b artifacts/qwen3-4b-fp8 artifacts/qwen3-4b-fp8-n32 artifacts/qwen3-4b-fp8-gu32 gpu/configs
OUT=$1; mkdir -p $OUT; export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1 NCCL_NVLS_ENABLE=0
t0=$(date +%s); say() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a $OUT/log.txt; }
bash tests/gpu/carry.sh --unpack
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl-b/*.whl > $OUT/wheels.log 2>&1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > $OUT/install.log 2>&1 || { cat $OUT/install.log; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee $OUT/gpu.txt
A=.cache/artifacts; C=.cache/gpu/configs
python3 tests/gpu/rerender.py $A/qwen3-4b-fp8 $A/qwen3-4b-fp8-n32 $A/qwen3-4b-fp8-gu32 2>&1 | tail -3 | tee -a $OUT/log.txt
prof() {  # art steps tag
  say "profile $1 steps $2 ($3)"
  timeout 90 python3 -m infc.cli bench profile --artifact $A/$1 --model-path $C/qwen3-4b-fp8 --load-format dummy --no-bandwidth \
    --reps 10 --steps $2 --out /tmp/p-$3-$1 2>&1 | grep -vE "Loading weights|it/s\]|^\s*$" | grep -E "^\| [0-9]+ \||^decode|rror|Trace" | head -12 >> $OUT/log.txt
}
for a in qwen3-4b-fp8 qwen3-4b-fp8-n32 qwen3-4b-fp8-gu32; do prof $a decode_b1,decode_b1_graph r1; done
for a in qwen3-4b-fp8 qwen3-4b-fp8-n32 qwen3-4b-fp8-gu32; do prof $a decode_b1_graph r2; done
(cd /tmp && tar czf $OUT/profiles.tgz p-*)
say done
