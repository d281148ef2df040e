#!/usr/bin/env bash
# Gather the pieces of .cache one GPU call needs into .cache/carry (the whole .cache/gpu is too big
# for the device tool's 64 MiB carry limit). Run after tests/gpu/prepare.py, then carry
# [".cache/carry", ".whl"] and start the device command with
#   bash tests/gpu/carry.sh --unpack; STAGES=... bash tests/gpu/session.sh $OUT/s1
#   tests/gpu/carry.sh PATH...       # paths under .cache/gpu or .cache/artifacts, e.g.
#   tests/gpu/carry.sh gpu/configs gpu/ranks/configs artifacts/qwen3-4b
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ "${1:-}" = --unpack ]; then        # on the GPU machine: put the pieces where prepare.py left them
  mkdir -p .cache/gpu .cache/artifacts
  cp -r .cache/carry/. .cache/
  exit 0
fi
rm -rf .cache/carry
for p in "$@"; do
  [ -e ".cache/$p" ] || { echo "carry.sh: .cache/$p does not exist (run tests/gpu/prepare.py first)" >&2; exit 1; }
  mkdir -p ".cache/carry/$(dirname "$p")"
  cp -r ".cache/$p" ".cache/carry/$p"
done
du -sh .cache/carry
