#!/usr/bin/env bash
# One call, branching on the card. H200: issue 46's acceptance (1024/128 throughput at 1, 32, 256
# concurrent of qwen3-4b and of qwen3-4b --enable-lora with 8 rank-16 adapters in turn, dummy weights,
# two rounds alternating; then the LoRA golden gate against HF + PEFT). H100: issue 43's draft-model
# GPU test through the verify program (INFC_VERIFY_PROGRAM=1), then issue 42's FP8 PARK A/B.
OUT=$1; mkdir -p $OUT; export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1 NCCL_NVLS_ENABLE=0
t0=$(date +%s); say() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a $OUT/log.txt; }
bash tests/gpu/carry.sh --unpack
[ -d /tmp/site/fastapi ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl-b/*.whl > $OUT/wheels.log 2>&1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > $OUT/install.log 2>&1 || { cat $OUT/install.log; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee $OUT/gpu.txt
git log --oneline -1 | tee -a $OUT/log.txt
A=.cache/artifacts; C=.cache/gpu/configs
if grep -q H200 $OUT/gpu.txt; then
  python3 tests/gpu/rerender.py $A/qwen3-4b $A/qwen3-4b-lora8r16 2>&1 | tail -2 | tee -a $OUT/log.txt
  M=$(cd tests/gpu && python3 -c "import models; print(models.model_dir('qwen3-4b'))" 2>>$OUT/log.txt | tail -1)
  mods=""
  for i in 1 2 3 4 5 6 7 8; do
    python3 tools/make_lora_adapter.py --model $M --out /tmp/infc-adapters/r16-$i --rank 16 --alpha 32 --seed $i --dtype bf16 >/dev/null
    mods="$mods a$i=/tmp/infc-adapters/r16-$i"
  done
  say "model and adapters"
  tp() {
    [ $(( $(date +%s) - t0 )) -gt ${LIMIT:-400} ] && { say "skipped $1: time"; return; }
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
  left=$(( ${GATE_END:-575} - ($(date +%s) - t0) ))
  say "lora gate ($left s left)"
  [ $left -gt 60 ] && timeout $left python3 -m pytest tests/gpu/test_lora_gpu.py -q -s -p no:cacheprovider 2>&1 \
    | tee $OUT/pytest-lora.log | grep -E "passed|failed|error|regret|p99|^E " | tail -30 | tee -a $OUT/log.txt
else
  python3 tests/gpu/rerender.py $A/qwen3-4b-narrow5 $A/qwen3-4b-l2 $A/qwen3-4b-fp8 $A/qwen3-4b-fp8-park 2>&1 | tail -2 | tee -a $OUT/log.txt
  say "draft-model gate through the verify program"
  INFC_VERIFY_PROGRAM=1 timeout 300 python3 -m pytest tests/gpu/test_spec_gpu.py -k draft_model -q -s -p no:cacheprovider 2>&1 \
    | tee $OUT/pytest-draft.log | grep -E "passed|failed|error|time per token|ms|^E " | tail -30 | tee -a $OUT/log.txt
  for r in 1 2; do for a in qwen3-4b-fp8 qwen3-4b-fp8-park; do
    [ $(( $(date +%s) - t0 )) -gt 520 ] && { say "skipped $a r$r: time"; continue; }
    say "profile $a r$r"
    timeout 60 python3 -m infc.cli bench profile --artifact $A/$a --model-path $C/qwen3-4b-fp8 --load-format dummy --no-bandwidth \
      --reps 10 --steps decode_b1,decode_b1_graph --out /tmp/p-$a-r$r 2>&1 | grep -E "^\| [1-4] \||^decode|rror|Trace" | head -7 | tee -a $OUT/log.txt
  done; done
  (cd /tmp && tar czf $OUT/results.tgz p-* 2>/dev/null)
fi
say done
