#!/usr/bin/env bash
# The one entry point of a GPU run, in a device call (from the repository root):
#   bash tests/gpu/run.sh OUT STAGE [STAGE ...]
#   bash tests/gpu/run.sh --list              # the stages
#   bash tests/gpu/run.sh --dry-run OUT STAGE ...   # what would run, where its results would land
# Each STAGE is one of session.sh's (suite, latency, throughput, server, twogpu, ...: the
# comment at the top of tests/gpu/session.sh says what each runs; consecutive ones run as one
# session) or one of the multi-step runs below (A/Bs of several builds, sweeps, a whole two-GPU
# call). Settings are environment variables, named at each stage. With one stage (or one run of
# consecutive session stages) the results land in OUT; with more, each in OUT/<its first stage>.
# Every run starts the same way: the carried .cache pieces unpacked (tests/gpu/carry.sh
# --unpack), the package installed from the tree, the card recorded in OUT/gpu.txt.
# docs/benchmarks.md, "On a GPU machine", lists the stages and what to prepare and carry for each.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."   # the repository root

SESSION_STAGES="suite families baseline latency profile profile-moe throughput startup startup-overlap server serve
  prefix generate hardening structured qwen35 ranks p2p deepseek dsv4 moe twogpu twogpu-allreduce server-families
  twogpu-nccl-env twogpu-server twogpu-bench overlap-ab ab tune quant kv-fp8 lora lora-profile lora-tune qwen35-prefix tier-throughput tier-prefix tier-probe gptoss cut-latency serve-gil serve-trace short-graphs"
RUN_STAGES="ab-latency ab-profile ab-throughput timeline find-time table-ab attn-variants by-card
  saturation pair"

# start OUT: OUT made, output unbuffered (what every run stage does first)
start() {
  OUT=$1
  mkdir -p "$OUT"
  export PYTHONUNBUFFERED=1
}

# unpack_carry: the carried .cache pieces put back where prepare.py left them (tests/gpu/carry.sh),
# if any were carried
unpack_carry() {
  if [ -d .cache/carry ] || [ -f .cache/carry.tar ]; then bash tests/gpu/carry.sh --unpack || exit 1; fi
}

# install_here [EXTRA_FIELDS]: the editable install, the card in $OUT/gpu.txt (nvidia-smi's fields,
# plus EXTRA_FIELDS, e.g. power.limit), the environment every GPU run sets, and `suffix`: "" on an
# H200 and "-h100" otherwise (tests/gpu/build_at.py builds NAME for the H200's table, NAME-h100).
install_here() {
  export TRITON_DEFAULT_FP_FUSION=1 NCCL_NVLS_ENABLE=0
  python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$OUT/install.log" 2>&1 \
    || { cat "$OUT/install.log"; exit 1; }
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem${1:+,$1} \
    --format=csv | tee "$OUT/gpu.txt"
  suffix=-h100
  if grep -q H200 "$OUT/gpu.txt"; then suffix=""; fi
}

# A one-off call's script (bench/results/*/call*.sh) starts the way the stages do by sourcing this
# file from the repository root:
#   source tests/gpu/run.sh --preamble "$1" [WHEELS]
# start and install_here, after the carried .cache pieces are unpacked and the wheels the GPU
# machine lacks (WHEELS, default .whl-b, if carried) are installed into /tmp/site on PYTHONPATH;
# then `say` (a line stamped with the seconds since the start, also into $OUT/log.txt) and `on_h200`
# are defined, INFC_COMMIT is exported (the carried stamp where unset) and written to $OUT/log.txt,
# and the script goes on with its shell options as they were.
if [ "${1:-}" = --preamble ]; then
  start "$2"
  t0=$(date +%s)
  say() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a "$OUT/log.txt"; }
  on_h200() { grep -q H200 "$OUT/gpu.txt"; }
  unpack_carry
  WHEELS=${3:-.whl-b}
  if [ -d "$WHEELS" ] && [ ! -f /tmp/site/.installed ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$WHEELS"/*.whl \
      > "$OUT/wheels.log" 2>&1 && touch /tmp/site/.installed
  fi
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  install_here
  # the commit: INFC_COMMIT, else the stamp prepare.py left beside the carried configs (the GPU
  # machine's git metadata can be an older commit's: 2026-12-07 #19 found HEAD a day behind)
  export INFC_COMMIT=${INFC_COMMIT:-$(cat .cache/gpu/configs/COMMIT 2>/dev/null || echo unknown)}
  echo "commit $INFC_COMMIT (the carried artifacts' stamp)" | tee -a "$OUT/log.txt"
  set +u +o pipefail
  return 0
fi

# The run stages: one function each, run in a subshell (its settings and working directory stay
# its own). Their bodies are not indented: the heredocs in them end at column 0.

# An artifact entry NAME[:VAR=VALUE] (ab-latency, timeline): its directory name, its environment
# (VAR=VALUE, or nothing), and a file-name label (NAME-VAR-VALUE)
art() { echo "${1%%:*}"; }
envs() { case "$1" in *:*) echo "${1#*:}";; esac; }
label() { echo "$1" | tr ':=' '--'; }

# Batch-1 latency of several builds of one model, in alternating rounds on one GPU, then a
# per-launch profile of batch-1 decode for each (one call; an A/B of a kernel or launch change):
#   ARTS="qwen3-30b-a3b qwen3-30b-a3b-pdl" CFG=.cache/gpu/configs/qwen3-30b-a3b \
#     bash tests/gpu/run.sh $OUT ab-latency
# ARTS: directories under .cache/artifacts (carried with tests/gpu/carry.sh, with gpu/configs), each
# optionally NAME:VAR=VALUE, run with that environment (e.g. qwen3-4b:INFC_NARROW=0: one build's
# narrow program against its decode program); results are named NAME-VAR-VALUE;
# CFG: the model directory (config only: weights made on the device, --load-format dummy);
# PROMPTS (32), ROUNDS (2), PROFILE (1: profile each build; 0: not).
run_ab_latency() (
start "$1"
install_here
CFG=${CFG:?CFG}
for a in $ARTS; do python3 tests/gpu/rerender.py ".cache/artifacts/$(art "$a")" 2>&1 | tail -1; done
for round in $(seq 1 ${ROUNDS:-2}); do
  for a in $ARTS; do
    echo "== $a, round $round"
    env $(envs "$a") timeout 200 python3 -m infc.cli bench latency --artifact ".cache/artifacts/$(art "$a")" \
      --model-path "$CFG" --load-format dummy --no-hf --prompts "${PROMPTS:-32}" --output-len 128 \
      --out "$OUT/$(label "$a")-$round" > "$OUT/$(label "$a")-$round.log" 2>&1
    grep -E "infc prompt" "$OUT/$(label "$a")-$round.log"
  done
done
[ "${PROFILE:-1}" = 1 ] && for a in $ARTS; do
  echo "== profile $a"
  env $(envs "$a") timeout 200 python3 -m infc.cli bench profile --artifact ".cache/artifacts/$(art "$a")" \
    --model-path "$CFG" --load-format dummy --steps decode_b1 --reps 10 --out "$OUT/profile-$(label "$a")" \
    > "$OUT/profile-$(label "$a").log" 2>&1
  grep -E "^decode_b1|^\| [0-9]+ \| " "$OUT/profile-$(label "$a").log" | head -16
done
)

# Per-launch profiles of the same steps for several builds of one model, in alternating rounds on
# one GPU (what stage ab-throughput does for whole runs, one step at a time):
#   ARTS="qwen3-4b-head qwen3-4b-il" CFG=.cache/gpu/configs/qwen3-4b \
#     PROFILES="--steps mixed_256 --mixed-decodes 194 --mixed-context 1100 --mixed-chunk 7800 --mixed-prompts 8;--steps decode_b1_graph" \
#     bash tests/gpu/run.sh $OUT ab-profile
# ARTS: directories under .cache/artifacts built by tests/gpu/build_at.py (NAME for an H200,
# NAME-h100 for an H100: the card that came picks); PROFILES: `bench profile` argument sets,
# separated by ';' (each run as profile-<i>); ROUNDS (1). Prints each step's summary row.
# Carry: tests/gpu/carry.sh gpu/configs artifacts/NAME artifacts/NAME-h100 ...
run_ab_profile() (
start "$1"
install_here
CFG=${CFG:?CFG}
IFS=';' read -r -a sets <<< "${PROFILES:?PROFILES}"
for round in $(seq 1 ${ROUNDS:-1}); do
  for i in "${!sets[@]}"; do
    for a in $ARTS; do
      d="$OUT/$a-p$i-$round"
      # shellcheck disable=SC2086  # each set is a list of arguments
      timeout 200 python3 -m infc.cli bench profile --artifact ".cache/artifacts/$a$suffix" --model-path "$CFG" \
        --load-format dummy --reps 10 --no-bandwidth --out "$d" ${sets[$i]} > "$d.log" 2>&1
      grep -E "^\| (decode|mixed|prefill|prefix)[a-z_0-9]* \| [a-z]" "$d.log" | sed "s/^/$a$suffix p$i r$round: /"
    done
  done
done
)

# `bench throughput` of several builds of one model in alternating rounds on one GPU (an A/B of a
# plan change at concurrency; stage ab-latency is its batch-1 twin), after optional isolated
# kernel timings (`infc tune run`):
#   ARTS="qwen3-4b-base qwen3-4b-new" CFG=.cache/gpu/configs/qwen3-4b \
#     TUNE=qwen3-4b-h100-widegemm bash tests/gpu/run.sh $OUT ab-throughput
# ARTS: directories under .cache/artifacts built by tests/gpu/build_at.py: NAME holds the H200
# table's plan, NAME-h100 the H100's, and the card that came picks (each run as built:
# --artifact); CFG: the model directory (config only: weights made on the device, --load-format
# dummy); CONCURRENCY (64,256), ROUNDS (2), BUDGETS (each value a run's
# --max-num-batched-tokens, results named NAME-bBUDGET-ROUND; default: the engine's, NAME-bdefault-ROUND); TUNE: folders under .cache/tune that `infc tune
# prepare` wrote, timed first with `infc tune run --any-gpu` (their tables are written under
# $OUT, never into the checkout). Carry: tests/gpu/carry.sh gpu/configs artifacts/NAME
# artifacts/NAME-h100 ... tune/FOLDER ...
run_ab_throughput() (
start "$1"
install_here
CFG=${CFG:?CFG}
for t in ${TUNE:-}; do
  echo "== tune run $t"
  timeout 300 python3 -m infc.cli tune run --dir ".cache/tune/$t" --any-gpu --write "$OUT/tune-$t.json" \
    --results-dir "$OUT" > "$OUT/tune-$t.log" 2>&1
  tail -25 "$OUT/tune-$t.log"
done
for round in $(seq 1 ${ROUNDS:-2}); do
  for a in $ARTS; do for b in ${BUDGETS:-default}; do
    art=".cache/artifacts/$a$suffix"
    name="$a-b$b-$round"
    echo "== $a$suffix, budget $b, round $round"
    timeout 300 python3 -m infc.cli bench throughput --artifact "$art" --model-path "$CFG" --load-format dummy \
      --concurrency "${CONCURRENCY:-64,256}" $([ "$b" = default ] || echo --max-num-batched-tokens "$b") --out "$OUT/$name" > "$OUT/$name.log" 2>&1
    grep -E "^concurrency|execute|decode|mixed" "$OUT/$name.log" | head -12
  done; done
done
)

# Graph-replay timelines (tests/gpu/timeline.py) of batch-1 decode for several builds of one model:
#   ARTS="qwen3-4b qwen3-4b:INFC_NARROW=0" CFG=.cache/gpu/configs/qwen3-4b CONTEXTS=32,1024 \
#     bash tests/gpu/run.sh $OUT timeline
# ARTS as in stage ab-latency (NAME[:VAR=VALUE], under .cache/artifacts), used as named.
run_timeline() (
start "$1"
install_here
CFG=${CFG:?CFG}
for a in $ARTS; do
  for c in ${CONTEXTS//,/ }; do
    out="$OUT/tl-$(label "$a")-$c"
    echo "== $a at context $c"
    env $(envs "$a") timeout 300 python3 tests/gpu/timeline.py --artifact ".cache/artifacts/$(art "$a")" \
      --model-path "$CFG" --context "$c" --reps "${REPS:-20}" --out "$out" > "$out.log" 2>&1
    tail -32 "$out.log"
  done
done
)

# Where a saturated server's time goes, in one call (issue 10, "find the time first"):
#   ART=qwen3-4b-head CFG=.cache/gpu/configs/qwen3-4b bash tests/gpu/run.sh $OUT find-time
# ART: a directory under .cache/artifacts built by tests/gpu/build_at.py (ART for an H200, ART-h100
# for an H100: the card that came picks). It runs, with the SM clock and power sampled every 100 ms
# into smi.csv (so a step's time can be read against the clock it ran at):
#   1. bench profile: batch-1 decode (eager and graph), the mixed step of `bench throughput` at 256
#      (MIXED_DECODES decodes at MIXED_CONTEXT tokens beside MIXED_PROMPTS prompts, MIXED_CHUNK
#      tokens in all; a saturated run's steps hold ~8 prompts of 1024), and
#      decode steps of WIDE_DECODES and MID_DECODES sequences;
#   2. bench throughput 1024/128 at CONCURRENCY (64,256);
#   3. bench latency (batch-1 TPOT / TTFT, no HF).
# FIND_STAGES (default "profile throughput latency") picks some of them. Carry: tests/gpu/carry.sh
# gpu/configs artifacts/ART artifacts/ART-h100.
run_find_time() (
start "$1"
install_here power.limit
CFG=${CFG:?CFG}
art=.cache/artifacts/${ART:?ART}$suffix
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,utilization.gpu,temperature.gpu \
  --format=csv,nounits -lms 100 > "$OUT/smi.csv" 2>/dev/null &
smi=$!
mark() { echo "$(date -u '+%Y/%m/%d %H:%M:%S.%3N') $*" | tee -a "$OUT/marks.txt"; }
common=(--artifact "$art" --model-path "$CFG" --load-format dummy)

STAGES=" ${FIND_STAGES:-profile throughput latency} "
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
)

# A tuning-table change A/B on one GPU in one call: `bench throughput` (and optionally `bench
# latency --no-hf`) of qwen3-4b with the table as committed against BASE_TABLE (the table before
# the change), in alternating rounds. The artifact must hold both tables' cubins (build it with
# each table into the same .cache/artifacts/qwen3-4b), so nothing compiles here.
#   BASE_TABLE=.cache/tuning-base/h200.json bash tests/gpu/run.sh $OUT table-ab
# CONCURRENCY (64,256), ROUNDS (2), LATENCY (0: skip; 1: bench latency --no-hf too).
run_table_ab() (
start "$1"
BASE_TABLE=${BASE_TABLE:?BASE_TABLE}
gpu=$(basename "$BASE_TABLE" .json)
cp "codegen_templates/tuning/$gpu.json" /tmp/table-new.json
# installs the package, makes the random qwen3-4b directory
STAGES=generate bash tests/gpu/session.sh "$OUT/setup" > "$OUT/setup.log" 2>&1
tail -3 "$OUT/setup.log"
M=/tmp/infc-models/qwen3-4b
for round in $(seq 1 ${ROUNDS:-2}); do
  for side in base new; do
    if [ $side = base ]; then cp "$BASE_TABLE" "codegen_templates/tuning/$gpu.json"
    else cp /tmp/table-new.json "codegen_templates/tuning/$gpu.json"; fi
    d="$OUT/$side-$round"; mkdir -p "$d"
    echo "== $side, round $round"
    timeout 240 python3 -m infc.cli bench throughput --model-path $M --concurrency "${CONCURRENCY:-64,256}" \
      --out "$d" > "$d/throughput.log" 2>&1
    grep -E "compile|^concurrency" "$d/throughput.log"
    if [ "${LATENCY:-0}" = 1 ]; then
      python3 tests/gpu/rerender.py .cache/artifacts/qwen3-4b 2>&1 | tail -1
      timeout 150 python3 -m infc.cli bench latency --artifact .cache/artifacts/qwen3-4b --model-path $M \
        --no-hf --out "$d" > "$d/latency.log" 2>&1
      grep -E "infc prompt" "$d/latency.log"
    fi
  done
done
cp /tmp/table-new.json "codegen_templates/tuning/$gpu.json"
)

# Issue 10's prefix-hit attention in one call on one GPU (bench/NOTES.md, "Issue 10's prefix-hit
# attention"): the short program's attention_mixed launch, per layer, in the step and issued alone
# (bench profile --isolate), for qwen3-4b as built and for each variant of its split-role tunables
# (tests/gpu/prepare.py ATTN_VARIANTS), at a 1k and a 16k cached prefix + 16 new tokens.
#   python tests/gpu/prepare.py base attnvar
#   tests/gpu/carry.sh gpu/configs artifacts/qwen3-4b $(cd .cache && ls -d artifacts/qwen3-4b-attn-*)
#   (device) bash tests/gpu/run.sh $OUT attn-variants
# VARIANTS / LENGTHS narrow it; ~20 s a profile.
run_attn_variants() (
start "$1"
# installs the package, makes the random qwen3-4b directory, re-renders qwen3-4b: the first profile
STAGES=profile PROFILE_ARGS="--steps prefix_hit,decode_b1 --isolate attention_cached,linear --reps 10" \
  bash tests/gpu/session.sh "$OUT/base-1024" > "$OUT/base-1024.log" 2>&1
grep -E "prefix_hit|decode_b1|attention_cached" "$OUT/base-1024.log" | head -12
vs=(${VARIANTS:-base $(cd .cache/artifacts && ls -d qwen3-4b-attn-* 2>/dev/null | sed 's/qwen3-4b-attn-//')})
python3 tests/gpu/rerender.py .cache/artifacts/qwen3-4b-attn-* 2>&1 | tail -8
for v in "${vs[@]}"; do
  art=.cache/artifacts/qwen3-4b-attn-$v
  [ "$v" = base ] && art=.cache/artifacts/qwen3-4b
  for L in ${LENGTHS:-1024 16384}; do
    [ "$v" = base ] && [ "$L" = 1024 ] && continue          # the first profile above
    mkdir -p "$OUT/$v-$L"
    echo "== $v, prefix $L"
    timeout 120 python3 -m infc.cli bench profile --artifact "$art" --model-path /tmp/infc-models/qwen3-4b \
      --steps prefix_hit --prefix-tokens "$L" --isolate attention_cached --reps 10 --no-bandwidth \
      --out "$OUT/$v-$L" > "$OUT/$v-$L.log" 2>&1
    grep -E "^prefix_hit|\| layer.3 \|" "$OUT/$v-$L.log" | head -3
  done
done
)

# One single-GPU call whose stages depend on the card that came (a call for nvidia-h200 gets an
# H100 or an H200):
#   ON_H200="latency prefix throughput moe deepseek serve" ON_H100="" bash tests/gpu/run.sh $OUT by-card
# runs session.sh with ON_H200's stages on an H200 and ON_H100's on an H100; an empty list ends
# the call at once (a few seconds of device time, plus the machine's start). Carry what the stages
# need (tests/gpu/carry.sh), for the default H200 list: after `tests/gpu/prepare.py base twogpu
# deepseek`, gpu/configs gpu/tiny-moe gpu/skipgram gpu/qwen-tokenizer gpu/deepseek-v2-lite-art
# artifacts/qwen3-4b artifacts/qwen3-30b-a3b.
run_by_card() (
start "$1"
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $card" | tee "$OUT/card.txt"
case $card in
  *H200*) stages=${ON_H200:-latency prefix throughput moe deepseek serve} ;;
  *) stages=${ON_H100:-} ;;
esac
[ -z "$stages" ] && { echo "nothing to run on this card"; exit 0; }
STAGES="$stages" bash tests/gpu/session.sh "$OUT/s" >"$OUT/console.log" 2>&1
tail -40 "$OUT/console.log"
)

# Issue 14's saturation sweep in one nvidia-h200-x2 call (bench/results/h200x2-dp-saturation-*):
# qwen3-30b-a3b (48 layers, dummy weights), 1024 in / 128 out, one GPU (GPU 0) past its KV-bound
# point, then the attention data-parallel ranks with EP over both GPUs; the ratio is of each
# side's best point. Prepare here, then carry .cache/carry:
#   python tests/gpu/prepare.py base twogpu
#   tests/gpu/carry.sh gpu/configs artifacts/qwen3-30b-a3b artifacts/qwen3-30b-a3b-dp2-ep2
#   (device) bash tests/gpu/run.sh $OUT saturation
# ONE=... / DP=...: the concurrencies of each side ("" skips it); ~5 minutes with the defaults.
run_saturation() (
start "$1"
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
)

# One nvidia-h200-x2 call (issue 14 first, issue 10 beside it), whichever cards come:
#   tests/gpu/prepare.py base twogpu; tests/gpu/carry.sh <the list below>; then on the device
#   bash tests/gpu/run.sh $OUT pair
# Phase A, in parallel: GPU 0 the one-GPU side of qwen3-30b-a3b's saturated throughput; GPU 1
# qwen3-4b's issue-10 benchmarks and the MoE / DeepSeek batch-1 latency (GPU1_H200_STAGES,
# GPU1_H100_STAGES). Phase B, both GPUs: the two ranks.
# Carry: gpu/configs gpu/ranks/configs gpu/tiny-moe gpu/skipgram gpu/qwen-tokenizer gpu/deepseek-v2-lite-art
#   artifacts/{qwen3-4b,qwen3-4b-tp2,qwen3-30b-a3b,qwen3-30b-a3b-tp2-ep2,
#   ranks-qwen3-30b-a3b-l4-tp2-ep2,deepseek-v2-lite-l8-tp2-ep2}
run_pair() (
start "$1"
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $card" | tee "$OUT/card.txt"
conc=${MOE_CONCURRENCY:-256,1024}
if [ "${ONE_GPU:-1}" = 0 ] && [[ $card != *H200* ]]; then
  echo "ONE_GPU=0 on $card: phase A skipped"
else
( export CUDA_VISIBLE_DEVICES=0
  mkdir -p "$OUT/moe-one"
  STAGES=twogpu-bench TWOGPU_BENCH=moe-throughput TWOGPU_CONCURRENCY=$conc TWOGPU_ONLY_ONE=1 \
    bash tests/gpu/session.sh "$OUT/moe-one" >"$OUT/moe-one/console.log" 2>&1 ) &
a=$!
( export CUDA_VISIBLE_DEVICES=1
  sleep 25     # session.sh installs the package: the two must not race
  # issue 10 (qwen3-4b), then issues 11 and 13 (batch-1 TPOT against the active floor); an H100
  # pair re-times only the batch-1 latencies (its issue-10 throughput numbers are in)
  case $card in
    *H200*) stages=${GPU1_H200_STAGES:-latency prefix throughput latency moe deepseek serve} ;;
    *) stages=${GPU1_H100_STAGES:-latency moe deepseek} ;;
  esac
  STAGES="$stages" bash tests/gpu/session.sh "$OUT/gpu1" >"$OUT/gpu1.log" 2>&1
  ) &
b=$!
wait $a $b
fi
mkdir -p "$OUT/ranks"
# the ranks overlap their steps by default; RANK_SYNC=1 times them synchronous too, DP=1 the
# attention data-parallel ranks (--data-parallel-size 2 --enable-expert-parallel), EP_GATHER=1
# with the dispatch's all-gather back (INFC_EP_GATHER), TWOGPU_TEST=1 runs the two-GPU test file
# (golden gates, overlapped tokens, a killed rank); ONE_GPU=0 skips phase A
STAGES="twogpu-bench" TWOGPU_BENCH=moe-throughput TWOGPU_CONCURRENCY=$conc TWOGPU_SKIP_ONE=1 \
  TWOGPU_RANK_SYNC=${RANK_SYNC:-} TWOGPU_EP_GATHER=${EP_GATHER:-} TWOGPU_DP=${DP:-} bash tests/gpu/session.sh "$OUT/ranks" >"$OUT/ranks/console.log" 2>&1 || true
if [ -n "${TWOGPU_TEST:-}" ]; then
  STAGES=twogpu TWOGPU_S=240 bash tests/gpu/session.sh "$OUT/twogpu-test" >"$OUT/twogpu-test.log" 2>&1
fi
)

is_in() { case " $(echo $2) " in *" $1 "*) return 0 ;; esac; return 1; }

if [ "${1:-}" = --list ]; then
  echo "session stages: $(echo $SESSION_STAGES)"
  echo "run stages: $(echo $RUN_STAGES)"
  exit 0
fi
dry=""
if [ "${1:-}" = --dry-run ]; then dry=1; shift; fi
OUT_ROOT=${1:?usage: tests/gpu/run.sh OUT STAGE [STAGE ...] (or --list)}
shift
[ $# -gt 0 ] || { echo "tests/gpu/run.sh: no stage given (tests/gpu/run.sh --list names them)" >&2; exit 2; }
for s in "$@"; do
  is_in "$s" "$SESSION_STAGES $RUN_STAGES" || {
    echo "tests/gpu/run.sh: unknown stage '$s' (session stages: $(echo $SESSION_STAGES); run stages: $(echo $RUN_STAGES))" >&2
    exit 2; }
done
# group consecutive session stages into one session; each run stage alone
groups=()
for s in "$@"; do
  last=$(( ${#groups[@]} - 1 ))
  if is_in "$s" "$SESSION_STAGES" && [ $last -ge 0 ] && is_in "${groups[$last]%% *}" "$SESSION_STAGES"; then
    groups[$last]="${groups[$last]} $s"
  else
    groups+=("$s")
  fi
done
# the carried pieces unpacked once for every stage
[ -z "$dry" ] && unpack_carry
rc=0
for g in "${groups[@]}"; do
  out=$OUT_ROOT
  [ ${#groups[@]} -gt 1 ] && out=$OUT_ROOT/${g%% *}
  first=${g%% *}
  if [ -n "$dry" ]; then
    if is_in "$first" "$SESSION_STAGES"; then echo "session [$g] -> $out"; else echo "run $g -> $out"; fi
  elif is_in "$first" "$SESSION_STAGES"; then
    STAGES="$g" bash tests/gpu/session.sh "$out" || rc=$?
  else
    "run_${first//-/_}" "$out" || rc=$?
  fi
done
# everything OUT holds, also as one archive first in its listing: the device tool brings back only
# a few files a call (tar xzf OUT/0-results.tgz on this side)
if [ -z "$dry" ] && [ -d "$OUT_ROOT" ]; then
  tmp=$(mktemp /tmp/results.XXXXXX.tgz)
  tar czf "$tmp" -C "$OUT_ROOT" --exclude=./0-results.tgz . && mv "$tmp" "$OUT_ROOT/0-results.tgz"
fi
exit $rc
