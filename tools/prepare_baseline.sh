#!/usr/bin/env bash
# Build a baseline commit's qwen3-4b artifact here, so a GPU session can time it beside the
# working tree's on the same card (`STAGES="... baseline" tests/gpu/session.sh`):
#   tools/prepare_baseline.sh COMMIT     # -> .cache/baseline (the commit's tree), .cache/baseline-art
# Carry .cache/baseline and .cache/baseline-art with the device call. Run tests/gpu/prepare.py
# first: the baseline is built from the same config.json (.cache/gpu/configs/qwen3-4b).
set -euo pipefail
cd "$(dirname "$0")/.."
commit=${1:?usage: tools/prepare_baseline.sh COMMIT}
rm -rf .cache/baseline .cache/baseline-art /tmp/infc-baseline-venv
git worktree prune
git worktree add -f --detach .cache/baseline "$commit" >/dev/null
rm -f .cache/baseline/.git          # a plain tree: it travels to the GPU machine as files
git worktree prune
# the baseline's own package, with this venv's dependencies after it on the path
python3 -m venv /tmp/infc-baseline-venv
site=$(.venv/bin/python -c "import site; print(site.getsitepackages()[0])")
bsite=$(/tmp/infc-baseline-venv/bin/python -c "import site; print(site.getsitepackages()[0])")
echo "$site" > "$bsite/zz-infc-deps.pth"
PYTHONPATH=$site /tmp/infc-baseline-venv/bin/pip install -q --no-deps --no-build-isolation -e .cache/baseline
for gpu in h100 h200; do        # as prepare.py builds the served artifact: plan.json is the H200 one
  (cd .cache/baseline && /tmp/infc-baseline-venv/bin/python -m infc.cli build \
     --model-path ../gpu/configs/qwen3-4b --out ../baseline-art/qwen3-4b --gpu $gpu | tail -1)
done
git rev-parse --short "$commit" > .cache/baseline-art/commit
echo "baseline $(cat .cache/baseline-art/commit) -> .cache/baseline-art/qwen3-4b"
