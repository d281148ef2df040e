#!/usr/bin/env bash
# One GPU session in one call: install, make models, run the GPU suite and the latency bench.
# Results under $OUT (pytest log, bench JSON + PNG). Bounded: each stage has a timeout.
set -uo pipefail
OUT=${OUT:-/tmp/infc-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$OUT/install.log" 2>&1 || { tail "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
timeout 120 python3 -c "import sys; sys.path.insert(0,'tests/gpu'); import models; [print(models.model_dir(m)) for m in ('qwen3-4b','llama-3.2-1b','tiny-moe')]" 2>&1 | tail -3
timeout ${SUITE_S:-300} python3 -m pytest tests/gpu -q -s -p no:cacheprovider -k "${PYTEST_K:-not smoke}" 2>&1 | grep -vE "Loading weights|it/s\]" | tee "$OUT/pytest.log" | tail -25
timeout ${BENCH_S:-240} python3 -m infc.cli bench latency --artifact generated/qwen3-4b --model-path /tmp/infc-models/qwen3-4b --out "$OUT" 2>&1 | grep -vE "Loading weights|it/s\]" | tail -12
ls "$OUT"
