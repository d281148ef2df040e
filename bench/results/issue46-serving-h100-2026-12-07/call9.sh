#!/usr/bin/env bash
# issue 46: 1024/128 throughput at 32 and 256 concurrent, LoRA (8 rank-16 adapters in turn) and base, two rounds
OUT=$1; mkdir -p $OUT; export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1 NCCL_NVLS_ENABLE=0
t0=$(date +%s); say() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a $OUT/log.txt; }
bash tests/gpu/carry.sh --unpack
[ -d /tmp/site/fastapi ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl-b/*.whl > $OUT/wheels.log 2>&1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > $OUT/install.log 2>&1 || { cat $OUT/install.log; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee $OUT/gpu.txt
A=.cache/artifacts
python3 tests/gpu/rerender.py $A/qwen3-4b $A/qwen3-4b-lora8r16 2>&1 | tail -2 | tee -a $OUT/log.txt
M=$(cd tests/gpu && python3 -c "import models; print(models.model_dir('qwen3-4b'))" 2>>$OUT/log.txt | tail -1)
mods=""
for i in 1 2 3 4 5 6 7 8; do
  [ -d /tmp/infc-adapters/r16-$i ] || python3 tools/make_lora_adapter.py --model $M --out /tmp/infc-adapters/r16-$i --rank 16 --alpha 32 --seed $i --dtype bf16 >/dev/null
  mods="$mods a$i=/tmp/infc-adapters/r16-$i"
done
say "model and adapters"
tp() {  # tag extra-args
  say "throughput $1"
  timeout 100 python3 -m infc.cli bench throughput --model-path $M --load-format dummy --concurrency 32,256 \
    --out /tmp/t-$1 "${@:2}" 2>&1 | grep -vE "it/s\]" | grep -E "concurrency|tok/s|TPOT|rror|Trace" | tail -6 | tee -a $OUT/log.txt
}
L="--enable-lora --max-loras 8 --max-lora-rank 16 --lora-modules $mods"
tp lora8-256-r1 $L
tp base-256-r1
tp lora8-256-r2 $L
tp base-256-r2
(cd /tmp && tar czf $OUT/results.tgz t-*256*)
say done
