#!/usr/bin/env bash
# The planted defects (tests/PLANTED_DEFECTS.md): apply each patch here, run the fast suite (no
# --exhaustive) with -x, and require it to fail; the patch is always reverted.
#   tests/planted/check.sh                 every patch, on the test files its `catch:` line names
#   tests/planted/check.sh --full          every patch, on the whole fast suite (make test's)
#   tests/planted/check.sh 03 07 ...       only these patches (by number)
# A patch whose file has moved (runtime/ grouped into subpackages) is applied to the one tracked
# file of the same name. Exit status: the number of defects the suite did not catch.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
full=0
picked=()
for a in "$@"; do
  if [ "$a" = --full ]; then full=1; else picked+=("$a"); fi
done

# the patch text with its paths pointed at where the file lives now
located() {
  local patch=$1 path base now
  path=$(sed -n 's|^+++ b/||p' "$patch")
  if [ -f "$path" ]; then cat "$patch"; return; fi
  base=$(basename "$path")
  now=$(git ls-files "*/$base" "$base" | head -2)
  if [ "$(printf '%s\n' "$now" | wc -l)" != 1 ] || [ -z "$now" ]; then
    echo "cannot find $path (or one file named $base)" >&2; return 1
  fi
  sed "s|a/$path|a/$now|; s|b/$path|b/$now|" "$patch"
}

applied=""
revert() { if [ -n "$applied" ]; then printf '%s\n' "$applied" | git apply -R -; applied=""; fi; }
trap revert EXIT
trap 'revert; exit 130' INT TERM

missed=0
for patch in tests/planted/[0-9]*.patch; do
  name=$(basename "$patch" .patch)
  if [ ${#picked[@]} -gt 0 ] && ! printf '%s\n' "${picked[@]}" | grep -qx "${name%%-*}"; then continue; fi
  text=$(located "$patch") || { missed=$((missed + 1)); continue; }
  if ! printf '%s\n' "$text" | git apply --check - 2>/dev/null; then
    echo "MISSED $name: the patch no longer applies (the code changed: re-plant it)"; missed=$((missed + 1)); continue
  fi
  printf '%s\n' "$text" | git apply - && applied=$text
  if [ $full = 1 ]; then
    targets=(-n auto)
  else
    eval "targets=($(sed -n 's/^catch: //p' "$patch"))"
  fi
  log=$(mktemp /tmp/planted-XXXXXX.log)
  timeout 1800 "$PY" -m pytest -x -q -p no:cacheprovider "${targets[@]}" > "$log" 2>&1
  rc=$?
  revert
  if [ $rc = 1 ]; then
    echo "caught $name: $(grep -m1 '^FAILED' "$log" | cut -c1-160)"
  else
    echo "MISSED $name: pytest exited $rc (see $log)"; missed=$((missed + 1))
  fi
done
exit $missed
