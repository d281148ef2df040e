#!/usr/bin/env bash
# Issue 14's saturation sweep in one nvidia-h200-x2 call (bench/results/h200x2-dp-saturation-*):
# qwen3-30b-a3b (48 layers, dummy weights), 1024 in / 128 out, one GPU (GPU 0) past its KV-bound
# point, then the attention data-parallel ranks with EP over both GPUs; the ratio is of each
# side's best point. Prepare here, then carry .cache/carry:
#   python tests/gpu/prepare.py base twogpu
#   tests/gpu/carry.sh gpu/configs artifacts/qwen3-30b-a3b artifacts/qwen3-30b-a3b-dp2-ep2
#   (device) bash tests/gpu/call_saturation.sh $OUT
# ONE=... / DP=...: the concurrencies of each side ("" skips it); ~5 minutes with the defaults.
. "$(dirname "$0")/call_start.sh" "$@"
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
one=${ONE-1024,2048}
dp=${DP-1024,1536,2048}
if [ -n "$one" ]; then
  ( export CUDA_VISIBLE_DEVICES=0
    STAGES=twogpu-bench TWOGPU_BENCH=moe-throughput TWOGPU_CONCURRENCY=$one TWOGPU_ONLY_ONE=1 \
      THROUGHPUT_S=${THROUGHPUT_S:-280} bash tests/gpu/session.sh "$OUT/one" >"$OUT/one.log" 2>&1 )
  grep -hE "concurrency|execute" "$OUT"/one/bench/*.log
fi
if [ -n "$dp" ]; then
  STAGES=twogpu-bench TWOGPU_BENCH=moe-throughput TWOGPU_CONCURRENCY=$dp TWOGPU_ONLY_DP=1 \
    THROUGHPUT_S=${THROUGHPUT_S:-280} bash tests/gpu/session.sh "$OUT/dp" >"$OUT/dp.log" 2>&1
  grep -hE "concurrency|execute|rror" "$OUT"/dp/bench/dp/*.log
fi
python3 - "$OUT" <<'PY'
import glob, json, sys
best = {}
for side, pat in (("one GPU", "one/bench/*.json"), ("DP2 x EP2", "dp/bench/dp/*.json")):
    for f in glob.glob(f"{sys.argv[1]}/{pat}"):
        pts = json.load(open(f))["points"]
        p = max(pts, key=lambda p: p["output_tok_s"])
        best[side] = p["output_tok_s"]
        print(f"{side}: best {p['output_tok_s']:.0f} tok/s at {p['concurrency']}")
if len(best) == 2:
    print(f"ratio of the best points: {best['DP2 x EP2'] / best['one GPU']:.3f}x")
PY
