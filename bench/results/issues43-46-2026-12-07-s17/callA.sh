#!/usr/bin/env bash
# Session #17 call A (asked three times; an H100 came each time): on an H200, issue 46's acceptance run
# as session #16 prepared it (1024/128 throughput at 1, 32, 256 concurrent of qwen3-4b and of
# qwen3-4b --enable-lora with 8 rank-16 adapters in turn, dummy weights, two rounds alternating;
# then the LoRA golden gate against HF + PEFT; GATE_END: the second the gate must end by); on
# another card nothing. Copied to the repository root to run.
if nvidia-smi --query-gpu=name --format=csv | grep -q H200; then
  exec bash bench/results/issues42-43-46-2026-12-07-s16/callA/callA.sh "$1"
fi
echo "not an H200: issue 46 needs one"
