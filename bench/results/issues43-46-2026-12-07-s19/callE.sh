#!/usr/bin/env bash
# Session #19 call E (H200): `infc tune run` of qwen3-4b's verify launches (5 rows: gemv, gemv_gated,
# lm_head_last; the H200 table has no verify entries, so VERIFY_DOT's defaults run) and of the LoRA
# build's narrow GEMVs (8 slots, rank 16: batch-1 TPOT +16 % in call A).
source tests/gpu/run.sh --preamble "$1"
for d in qwen3-4b-verify5-h200 qwen3-4b-lora8r16-narrow-h200; do
  say "tune run $d"
  mkdir -p $OUT/$d
  timeout 200 python3 -m infc.cli tune run --dir .cache/tune/$d --results-dir $OUT/$d --write $OUT/$d/h200.json \
    > $OUT/$d.log 2>&1; tail -30 $OUT/$d.log
done
say done
