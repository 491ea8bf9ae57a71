#!/usr/bin/env bash
# Fuzzes every decoder of untrusted bytes (fuzz/fuzz_targets) for SECONDS each (default 60),
# and fails if any target crashes. Installs cargo-fuzz if missing. The toolchain here is
# stable, so cargo-fuzz runs without a sanitizer (-s none) and with RUSTC_BOOTSTRAP=1 for
# the flags it passes to rustc.
#
# Each target starts from its seeds (fuzz/seeds/<target>, inputs recorded on the test bed)
# and its regressions (fuzz/regressions/<target>, inputs that once crashed it: every one is
# run again each time). Neither folder is written to: the corpus a run grows lives in a
# temporary folder, and a crashing input is left in fuzz/artifacts/<target>/, to be copied
# into fuzz/regressions/<target>/ once the bug is fixed.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
seconds=${1:-60}
case "$seconds" in
  '' | *[!0-9]*) echo "usage: scripts/fuzz.sh [SECONDS per target]" >&2; exit 2 ;;
esac
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
export RUSTC_BOOTSTRAP=1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cargo fuzz build -O -s none
summary=()
failed=()
for target in $(cargo fuzz list); do
  echo "==> fuzzing $target for ${seconds}s"
  mkdir -p "$work/$target" "artifacts/$target"
  inputs=("$work/$target")
  for dir in "seeds/$target" "regressions/$target"; do
    [ -d "$dir" ] && inputs+=("$dir")
  done
  log=$work/$target.log
  status=0
  cargo fuzz run -O -s none "$target" "${inputs[@]}" -- \
    -max_total_time="$seconds" -artifact_prefix="artifacts/$target/" >"$log" 2>&1 || status=$?
  grep -E '^#[0-9]+[[:space:]]+(INITED|DONE)|^Done ' "$log" || true
  if [ "$status" -ne 0 ]; then
    failed+=("$target")
    tail -40 "$log"
    echo "error: $target crashed (exit $status); its input is in fuzz/artifacts/$target/" \
      "(keep it in fuzz/regressions/$target/ once fixed)" >&2
  fi
  runs=$(sed -n 's/^Done \([0-9]*\) runs in \([0-9]*\) second.*/\1 runs in \2 s/p' "$log" | tail -1)
  summary+=("$target: ${runs:-no run count}")
done
echo "==> fuzzing: inputs run per target"
printf '    %s\n' "${summary[@]}"
if [ ${#failed[@]} -gt 0 ]; then
  echo "error: fuzz targets crashed: ${failed[*]}" >&2
  exit 1
fi
