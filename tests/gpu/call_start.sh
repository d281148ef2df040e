# The start every tests/gpu/call_*.sh shares, sourced as its first line:
#   . "$(dirname "$0")/call_start.sh" "$@"
# OUT (the first argument) made, the repository root the working directory, the carried .cache
# pieces put back where prepare.py left them (tests/gpu/carry.sh --unpack), output unbuffered.
set -uo pipefail
OUT=${1:?OUT}
cd "$(dirname "$0")/../.."
bash tests/gpu/carry.sh --unpack
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
