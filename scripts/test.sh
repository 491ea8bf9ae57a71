#!/usr/bin/env bash
# Runs every rdmamig test: unit and property tests, real-QEMU component tests, and the
# test-bed scenarios (QEMU TCG guests with Soft-RoCE in a network namespace of their own).
# Installs what is missing first. Needs root (network namespaces, taps).
set -euo pipefail
cd "$(dirname "$0")/.."
trap 'echo "error: scripts/test.sh stopped at line $LINENO: \"$BASH_COMMAND\" exited with status $?" >&2' ERR
# Each step says when it started and how far into the run, so that a log shows where the
# time went (CI's whole run must stay under an hour).
started=$SECONDS
step() { echo "==> [$(date +%T), $((SECONDS - started)) s in] $*"; }

scripts/setup.sh

step "format and lints"
for tool in rustfmt clippy; do
  if ! cargo "${tool#rust}" --version >/dev/null 2>&1; then
    echo "error: cargo ${tool#rust} is not installed; run: rustup component add $tool" >&2
    exit 1
  fi
done
cargo fmt --all --check
cargo clippy --release --workspace --all-targets -- -D warnings
# --all-targets skips the gold scenario (`test = false`, tests/Cargo.toml): lint it by name.
cargo clippy --release -p rdmamig-testbed --test gold -- -D warnings

step "unit, property and component tests"
cargo test --release --workspace --exclude rdmamig-testbed

# The crash scenarios need a daemon that aborts at a named phase; only a build with the
# fault-injection feature can, and it is kept apart as rdmamig-fault-injection. The migrator's
# own tests above built target/release/rdmamig with that feature, so the release build is
# put back for every other scenario.
step "the test bed's daemons: the release build, and one with fault injection"
cargo build --release -p rdmamig-migrator --bin rdmamig --features fault-injection
cp target/release/rdmamig target/release/rdmamig-fault-injection
# --lib builds librdmamig_preload.so too (a cdylib, which --bins alone leaves out).
cargo build --release --workspace --bins --lib

# Every decoder of untrusted bytes, fuzzed for a bounded time; a crash fails the run.
step "fuzzing (20 s per target)"
scripts/fuzz.sh 20

step "test-bed scenarios (one at a time: each runs several TCG guests)"
cargo test --release -p rdmamig-testbed -- --test-threads=1

# Two nested hosts with real SR-IOV VFs through VFIO (docs/testbed.md). A nested move takes
# minutes, so CI runs the two scenarios that cover the most from one base: a reconnect move
# with live traffic while a raw verbs program holds the VF, and beside it the naive move
# (unplug, migrate, plug) with what it loses. `--test gold` alone runs all five.
step "the gold scenario on real VFs (two nested hosts; about 17 minutes)"
cargo test --release -p rdmamig-testbed --test gold -- held_device naive
step "all tests passed"
