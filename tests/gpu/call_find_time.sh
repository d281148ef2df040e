#!/usr/bin/env bash
# Where a saturated server's time goes, in one call (issue 10, "find the time first"):
#   ART=qwen3-4b-head CFG=.cache/gpu/configs/qwen3-4b bash tests/gpu/call_find_time.sh $OUT
# ART: a directory under .cache/artifacts built by tests/gpu/build_at.py (ART for an H200, ART-h100
# for an H100: the card that came picks). It runs, with the SM clock and power sampled every 100 ms
# into smi.csv (so a step's time can be read against the clock it ran at):
#   1. bench profile: batch-1 decode (eager and graph), the mixed step of `bench throughput` at 256
#      (MIXED_DECODES decodes at MIXED_CONTEXT tokens beside MIXED_PROMPTS prompts, MIXED_CHUNK
#      tokens in all; a saturated run's steps hold ~8 prompts of 1024), and
#      decode steps of WIDE_DECODES and MID_DECODES sequences;
#   2. bench throughput 1024/128 at CONCURRENCY (64,256);
#   3. bench latency (batch-1 TPOT / TTFT, no HF).
# STAGES (default "profile throughput latency") picks some of them. Carry: tests/gpu/carry.sh
# gpu/configs artifacts/ART artifacts/ART-h100.
. "$(dirname "$0")/call_start.sh" "$@"
install_here power.limit
CFG=${CFG:?CFG}
art=.cache/artifacts/${ART:?ART}$suffix
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,utilization.gpu,temperature.gpu \
  --format=csv,nounits -lms 100 > "$OUT/smi.csv" 2>/dev/null &
smi=$!
mark() { echo "$(date -u '+%Y/%m/%d %H:%M:%S.%3N') $*" | tee -a "$OUT/marks.txt"; }
common=(--artifact "$art" --model-path "$CFG" --load-format dummy)

STAGES=" ${STAGES:-profile throughput latency} "
if [[ $STAGES == *" profile "* ]]; then
mark profile-start
timeout 200 python3 -m infc.cli bench profile "${common[@]}" --out "$OUT/profile" --reps 10 \
  --steps decode_b1,decode_b1_graph,mixed_256,decode_wide \
  --mixed-decodes "${MIXED_DECODES:-194}" --mixed-context "${MIXED_CONTEXT:-1100}" \
  --mixed-chunk "${MIXED_CHUNK:-7800}" --mixed-prompts "${MIXED_PROMPTS:-8}" > "$OUT/profile.log" 2>&1
mark profile-end
grep -E "^\| (decode|mixed|prefill)" "$OUT/profile.log" | head -8
for n in ${WIDE_DECODES-236} ${MID_DECODES-63}; do
  mark "profile-decode-$n-start"
  timeout 120 python3 -m infc.cli bench profile "${common[@]}" --out "$OUT/profile-decode-$n" --reps 10 \
    --steps decode_wide --mixed-decodes "$n" --mixed-context "${MIXED_CONTEXT:-1100}" --no-bandwidth \
    > "$OUT/profile-decode-$n.log" 2>&1
  mark "profile-decode-$n-end"
  grep -E "^\| decode_wide" "$OUT/profile-decode-$n.log" | head -2
done
fi
if [[ $STAGES == *" throughput "* ]]; then
mark throughput-start
timeout 240 python3 -m infc.cli bench throughput "${common[@]}" --concurrency "${CONCURRENCY:-64,256}" \
  --out "$OUT/throughput" > "$OUT/throughput.log" 2>&1
mark throughput-end
grep -E "^concurrency|execute|decode|mixed" "$OUT/throughput.log" | head -12
fi
if [[ $STAGES == *" latency "* ]]; then
mark latency-start
timeout 200 python3 -m infc.cli bench latency "${common[@]}" --no-hf --out "$OUT/latency" > "$OUT/latency.log" 2>&1
mark latency-end
tail -6 "$OUT/latency.log"
fi
kill $smi 2>/dev/null
# the clock and power while the throughput run's steps ran
python3 - "$OUT" <<'EOF'
import csv, sys, datetime as dt
out = sys.argv[1]
marks = {}
for line in open(f"{out}/marks.txt"):
    d, t, name = line.split(maxsplit=2)
    marks[name.strip()] = dt.datetime.strptime(f"{d} {t}", "%Y/%m/%d %H:%M:%S.%f")
rows = []
for r in csv.reader(open(f"{out}/smi.csv")):
    try:
        rows.append((dt.datetime.strptime(r[0].strip(), "%Y/%m/%d %H:%M:%S.%f"), float(r[1]), float(r[3]), float(r[4])))
    except (ValueError, IndexError):
        pass
for stage in ("profile", "throughput", "latency"):
    a, b = marks.get(f"{stage}-start"), marks.get(f"{stage}-end")
    busy = [x for x in rows if a and b and a <= x[0] <= b and x[3] >= 50]
    if busy:
        clk = sorted(x[1] for x in busy)
        pw = sorted(x[2] for x in busy)
        print(f"{stage}: {len(busy)} busy samples, SM clock median {clk[len(clk)//2]:.0f} MHz "
              f"(p10 {clk[len(clk)//10]:.0f}), power median {pw[len(pw)//2]:.0f} W (max {pw[-1]:.0f})")
EOF
