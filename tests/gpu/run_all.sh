#!/usr/bin/env bash
# The GPU suite in one go, on a GPU machine that reaches no package registry:
#   tests/gpu/run_all.sh OUT_DIR
# Needs what tests/gpu/prepare.py built on the CPU machine (generated/*/bin, .cache/gpu) and,
# for missing packages, wheels in .whl/. Logs and results land in OUT_DIR.
set -uo pipefail
OUT=${1:-${OUT:-/tmp/infc-gpu-out}}
mkdir -p "$OUT"
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import sys; sys.path.insert(0,'tests/gpu'); import models; [models.model_dir(m) for m in ('qwen3-4b','llama-3.2-1b','tiny-moe')]" 2>&1 | tail -3
python3 -m pytest tests/gpu -x -q -p no:cacheprovider ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/pytest.log"
