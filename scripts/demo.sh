#!/usr/bin/env bash
# The rdmamig demo: boots a peer VM and a VM with a Soft-RoCE NIC on the built-in test bed,
# runs RDMA traffic both ways, moves the VM to another QEMU process with `rdmamig migrate`,
# and prints the move's timeline and the switching time the application saw; then does
# the same move naively (unplug, migrate, plug, no coordination) for comparison.
# Installs what is missing first. Needs root (network namespaces, taps).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec target/release/rdmamig-demo "$@"
