#!/usr/bin/env bash
# call 1 (an H100 came): the skinny-GEMM probe, then callFP8.sh (the FP8 narrow tiles' A/B)
OUT=$1; mkdir -p $OUT
timeout 260 python3 tools/experiments/skinny_gemm_probe.py $OUT/probe --rows 5 2>&1 | grep -v "^\s*$" | tail -40 | tee $OUT/probe.log
bash callFP8.sh $OUT
