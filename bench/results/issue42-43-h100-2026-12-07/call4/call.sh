#!/usr/bin/env bash
# issue 43, call 4: from "best" (pre with gate|up unsplit) one change at a time, and the plain build (verify rows on the
# decode program); issue 42: qwen3-4b-fp8 with its split GEMVs' partials parked by plain stores (PARK store).
OUT=$1; mkdir -p $OUT; export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1 NCCL_NVLS_ENABLE=0
t0=$(date +%s); say() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a $OUT/log.txt; }
bash tests/gpu/carry.sh --unpack
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl-b/*.whl > $OUT/wheels.log 2>&1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > $OUT/install.log 2>&1 || { cat $OUT/install.log; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee $OUT/gpu.txt
A=.cache/artifacts; C=.cache/gpu/configs
V="best park q32 q1 od32"
python3 tests/gpu/rerender.py $A/qwen3-4b $A/qwen3-4b-fp8 $A/qwen3-4b-fp8-park $(for v in $V; do echo $A/qwen3-4b-v5-$v; done) 2>&1 | tail -8 | tee -a $OUT/log.txt
sv() {  # artifact tag
  [ $(( $(date +%s) - t0 )) -gt 200 ] && { say "skipped $1 $2: time"; return; }
  say "spec-verify $1 ($2)"
  timeout 60 python3 -m infc.cli bench spec-verify --artifact $A/$1 --model-path $C/qwen3-4b --load-format dummy \
    --batches 1 --drafts 0,1,4 --out /tmp/sv-$1-$2 2>&1 | grep -E "drafts|rror|Trace" | tail -4 >> $OUT/log.txt
}
for r in r1 r2; do
  for v in $V; do sv qwen3-4b-v5-$v $r; done
  sv qwen3-4b $r
done
for r in r1 r2; do for a in qwen3-4b-fp8 qwen3-4b-fp8-park; do
  say "profile $a ($r)"
  timeout 60 python3 -m infc.cli bench profile --artifact $A/$a --model-path $C/qwen3-4b-fp8 --load-format dummy --no-bandwidth \
    --reps 10 --steps decode_b1,decode_b1_graph --out /tmp/p-$a-$r 2>&1 | grep -E "^\| [1-4] \||^decode|rror|Trace" | head -7 >> $OUT/log.txt
done; done
say "profile best"
timeout 45 python3 -m infc.cli bench profile --artifact $A/qwen3-4b-v5-best --model-path $C/qwen3-4b --load-format dummy --no-bandwidth \
  --reps 10 --steps decode_b1_graph,verify_b1 --verify-drafts 4 --out /tmp/p-best 2>&1 | grep -E "^\| [1-6] \||^verify|^decode|rror|Trace" | head -9 >> $OUT/log.txt
(cd /tmp && tar czf $OUT/runs.tgz sv-* p-* 2>/dev/null)
say done
