# The start every tests/gpu/call_*.sh shares, sourced as its first line:
#   . "$(dirname "$0")/call_start.sh" "$@"
# (or `. tests/gpu/call_start.sh OUT` from the repository root, in a device command)
# OUT (the first argument) made, the repository root the working directory, the carried .cache
# pieces put back where prepare.py left them (tests/gpu/carry.sh --unpack), output unbuffered.
set -uo pipefail
OUT=${1:?OUT}
cd "$(dirname "${BASH_SOURCE[0]}")/../.."   # the repository root, also when sourced by hand
bash tests/gpu/carry.sh --unpack
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

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

# An artifact entry NAME[:VAR=VALUE] (call_ab_latency.sh, call_timeline.sh): its directory name, its
# environment (VAR=VALUE, or nothing), and a file-name label (NAME-VAR-VALUE)
art() { echo "${1%%:*}"; }
envs() { case "$1" in *:*) echo "${1#*:}";; esac; }
label() { echo "$1" | tr ':=' '--'; }
