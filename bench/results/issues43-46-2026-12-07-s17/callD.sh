#!/usr/bin/env bash
# Session #17 call D (H100): ncu on the verify program's GEMVs (qwen3-4b-v5-best, verify_b1 eager,
# one sequence at k = 4: 5 rows), where the q|k|v and o launches take 23.0 / 15.6 µs against the
# bare skinny GEMM's 12.7 / 9.3: speed of light, warp stalls, launch and occupancy, per kernel.
source tests/gpu/run.sh --preamble "$1"
A=.cache/artifacts; C=.cache/gpu/configs
python3 tests/gpu/rerender.py $A/qwen3-4b-v5-best 2>&1 | tail -1 | tee -a $OUT/log.txt
python3 - <<'PY' | tee $OUT/kernels.txt
import json
p = json.load(open(".cache/artifacts/qwen3-4b-v5-best/plan.json"))
for prog, body in p["programs"].items():
    if prog in ("verify", "narrow"):
        for l in body.get("layer", body.get("launches", []))[:8] if isinstance(body, dict) else body[:8]:
            print(prog, json.dumps(l)[:300])
PY
say "ncu"
timeout 240 /usr/local/cuda/bin/ncu --kernel-name regex:gemv --launch-skip 150 --launch-count 12 \
  --section SpeedOfLight --section WarpStateStats --section LaunchStats --section Occupancy --section MemoryWorkloadAnalysis \
  -o /tmp/ncu-v -f python3 -m infc.cli bench profile --artifact $A/qwen3-4b-v5-best --model-path $C/qwen3-4b --load-format dummy \
  --no-bandwidth --reps 3 --steps verify_b1 --verify-drafts 4 --out /tmp/p-ncu > $OUT/ncu.log 2>&1
tail -5 $OUT/ncu.log | tee -a $OUT/log.txt
[ -f /tmp/ncu-v.ncu-rep ] && cp /tmp/ncu-v.ncu-rep $OUT/ && timeout 60 /usr/local/cuda/bin/ncu -i /tmp/ncu-v.ncu-rep --page details --csv > $OUT/ncu-details.csv 2>&1
wc -l $OUT/ncu-details.csv 2>/dev/null | tee -a $OUT/log.txt
say done
