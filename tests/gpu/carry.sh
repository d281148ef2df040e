#!/usr/bin/env bash
# Gather the pieces of .cache one GPU call needs into .cache/carry (the whole .cache/gpu is too big
# for the device tool's 64 MiB carry limit). Run after tests/gpu/prepare.py, then carry
# [".cache/carry.tar", ".whl"] (the same pieces in one file) and start the device command with
#   bash tests/gpu/run.sh $OUT STAGE ...     (run.sh unpacks the carried pieces itself)
#   tests/gpu/carry.sh PATH...       # paths under .cache/gpu or .cache/artifacts, e.g.
#   tests/gpu/carry.sh gpu/configs gpu/ranks/configs artifacts/qwen3-4b
#   tests/gpu/carry.sh --table h200 PATH...   # only the H200 table's cubins (a call naming nvidia-h200)
#   tests/gpu/carry.sh --with .whl PATH...     # and check the call's size with the wheels it carries
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
# --with DIR (repeatable): a folder the call carries beside .cache/carry.tar (the wheels, e.g. .whl):
# counted into the call's size below, which must stay under the device tool's 64 MiB
table=
with=()
while [ "${1:-}" = --table ] || [ "${1:-}" = --with ]; do
  if [ "$1" = --table ]; then table=$2; else with+=("$2"); fi
  shift 2
done
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
# what the call sends, as the device tool counts it (files on disk, in KiB): the checkout's tracked
# and untracked-not-ignored files, the tar and the --with folders (a call over the limit is refused
# at once; one whose wheels were left out to fit fails on the machine, after its start)
tree=$( (git ls-files -z; git ls-files -z --others --exclude-standard) | du -c --files0-from=- 2>/dev/null | tail -1 | cut -f1)
extra=$(du -sk .cache/carry.tar ${with[@]+"${with[@]}"} | awk '{s += $1} END {print s}')
total=$((tree + extra))
echo "the call: $((total / 1024)) MiB of 64 (checkout $((tree / 1024)), carry.tar and --with $((extra / 1024)))"
if [ "$total" -gt 65536 ]; then
  echo "carry.sh: over the device tool's 64 MiB: carry fewer pieces (--table, fewer artifacts) or fewer wheels" >&2
  exit 1
fi
