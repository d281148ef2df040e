#!/usr/bin/env bash
# Gather the pieces of .cache one GPU call needs into .cache/carry (the whole .cache/gpu is too big
# for the device tool's 64 MiB carry limit). Run after tests/gpu/prepare.py, then carry
# [".cache/carry.tar", ".whl"] (the same pieces in one file) and start the device command with
#   bash tests/gpu/run.sh $OUT STAGE ...     (run.sh unpacks the carried pieces itself)
#   tests/gpu/carry.sh PATH...       # paths under .cache/gpu or .cache/artifacts, e.g.
#   tests/gpu/carry.sh gpu/configs gpu/ranks/configs artifacts/qwen3-4b
#   tests/gpu/carry.sh --table h200 PATH...   # only the H200 table's cubins (a call naming nvidia-h200)
# Artifacts' cubins go into one pool (.cache/carry/binpool, each file once: a cubin's name holds
# its source hash), so builds that differ in a few kernels (an A/B, leave-one-out variants) cost
# only those kernels; each artifact keeps the list of its bin/ (bin.list) to be rebuilt from it.
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ "${1:-}" = --unpack ]; then        # on the GPU machine: put the pieces where prepare.py left them
  mkdir -p .cache/gpu .cache/artifacts
  if [ -f .cache/carry.tar ]; then rm -rf .cache/carry; tar xf .cache/carry.tar -C .cache && rm .cache/carry.tar; fi
  find .cache/carry -name '*.gz' -exec gunzip -f {} +      # the large files, packed below
  (cd .cache/carry && find . -path ./binpool -prune -o -type f -print) | while read -r f; do
    mkdir -p ".cache/$(dirname "$f")"
    if [ "$(basename "$f")" = bin.list ]; then
      b=".cache/$(dirname "$f")/bin"; mkdir -p "$b"
      while read -r k; do cp .cache/carry/binpool/"$k" "$b/$k"; done < ".cache/carry/$f"
    else
      cp ".cache/carry/$f" ".cache/$f"
    fi
  done
  exit 0
fi
# --table h200|h100 first: only the cubins that table's plans name (tests/gpu/carry_table.py), for a
# call that names its card
table=
if [ "${1:-}" = --table ]; then table=$2; shift 2; fi
rm -rf .cache/carry
mkdir -p .cache/carry/binpool
for p in "$@"; do
  [ -e ".cache/$p" ] || { echo "carry.sh: .cache/$p does not exist (run tests/gpu/prepare.py first)" >&2; exit 1; }
  mkdir -p ".cache/carry/$(dirname "$p")"
  cp -r ".cache/$p" ".cache/carry/$p"
  find ".cache/carry/$p" -type d -name bin | while read -r b; do
    ls "$b" > "$(dirname "$b")/bin.list"
    cp -n "$b"/* .cache/carry/binpool/ 2>/dev/null || true
    rm -rf "$b"
  done
done
# the device tool's 64 MiB counts the files as they lie on disk, the checkout's own included (~51 MiB
# of 4 KiB blocks at c4b8fadb, against ~42 MiB of bytes: measured by which calls it refused; ~44 MiB
# since generated/ keeps each kernel source once, tools/generated_pool.py): every file
# over 16 KiB travels gzipped (the tokenizer's JSON, kernel sources, cubins: 33 -> 19 MB for a
# 22-variant sweep), and --unpack restores them
find .cache/carry -type f -size +16k ! -name '*.gz' -print0 | xargs -0 -r gzip -9
if [ -n "$table" ]; then python3 tests/gpu/carry_table.py .cache/carry "$table"; fi
# ... and as one file: hundreds of small ones would each take a block (carry [".cache/carry.tar"])
rm -f .cache/carry.tar
tar cf .cache/carry.tar -C .cache carry
ls -la .cache/carry.tar | awk '{print $5 " bytes: .cache/carry.tar"}'
