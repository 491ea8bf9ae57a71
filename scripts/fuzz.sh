#!/usr/bin/env bash
# Fuzzes every decoder of untrusted bytes (fuzz/fuzz_targets) for SECONDS each (default 60).
# Installs cargo-fuzz if missing. The toolchain here is stable, so cargo-fuzz runs without
# a sanitizer (-s none) and with RUSTC_BOOTSTRAP=1 for the flags it passes to rustc.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
seconds=${1:-60}
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
export RUSTC_BOOTSTRAP=1
for target in $(cargo fuzz list); do
  echo "==> fuzzing $target for ${seconds}s"
  cargo fuzz run -O -s none "$target" -- -max_total_time="$seconds"
done
