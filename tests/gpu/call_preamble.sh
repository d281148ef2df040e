# The start every one-off device call's script shares (bench/results/*/call*.sh), sourced first
# from the repository root:
#   source tests/gpu/call_preamble.sh "$1" [WHEELS]
# It makes OUT, defines `say` (a line stamped with the seconds since the start, also into
# $OUT/log.txt), unpacks the carried .cache pieces (tests/gpu/carry.sh --unpack), installs the
# wheels the GPU machine lacks (WHEELS, default .whl-b, if carried) into /tmp/site on PYTHONPATH,
# installs infc from the tree, and records the card ($OUT/gpu.txt; `on_h200` tests it) and the
# commit with any uncommitted tracked changes ($OUT/log.txt). The stages of tests/gpu/run.sh do
# the same for themselves.
OUT=$1
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1 NCCL_NVLS_ENABLE=0
t0=$(date +%s)
say() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a "$OUT/log.txt"; }
on_h200() { grep -q H200 "$OUT/gpu.txt"; }
bash tests/gpu/carry.sh --unpack
WHEELS=${2:-.whl-b}
if [ -d "$WHEELS" ] && [ ! -f /tmp/site/.installed ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$WHEELS"/*.whl \
    > "$OUT/wheels.log" 2>&1 && touch /tmp/site/.installed
fi
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/install.log" 2>&1 \
  || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
{ git log --oneline -1; git status --short --untracked-files=no; } | tee -a "$OUT/log.txt"
