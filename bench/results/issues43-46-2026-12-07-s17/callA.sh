#!/usr/bin/env bash
# One call, branching on the card (session #17). H200: issue 46's acceptance (1024/128 throughput at
# 1, 32, 256 concurrent of qwen3-4b and of qwen3-4b --enable-lora with 8 rank-16 adapters in turn,
# dummy weights, two rounds alternating; then the LoRA golden gate against HF + PEFT). Another card: nothing
# (the trained-model exactness ran on an H100 in call B).
source tests/gpu/call_preamble.sh "$1"
A=.cache/artifacts; C=.cache/gpu/configs
if on_h200; then
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
  say "not an H200: issue 46 needs one"
fi
say done
