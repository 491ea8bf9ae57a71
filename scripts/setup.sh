#!/usr/bin/env bash
# Installs what rdmamig needs on a fresh Debian 12 machine and builds the workspace.
# Idempotent: packages already present are not reinstalled. Needs root (apt, namespaces).
set -euo pipefail
cd "$(dirname "$0")/.."

# What each package is for:
#   qemu-system-x86     the test-bed VMs (TCG) and their QMP, hot-plug and migration
#   linux-image-amd64   the guest kernel with Soft-RoCE (rdma_rxe), rdma_cm and uverbs
#   busybox-static      the guest initramfs userland
#   rdma-core ibverbs-providers libibverbs-dev librdmacm-dev
#                       libibverbs/librdmacm and the rxe provider (guest) and headers (build)
#   ibverbs-utils rdmacm-utils perftest
#                       ibv_devinfo, rping, ib_send_* in the guest for checks and baselines
#   libclang-dev pkg-config   bindgen for rdma-sys
#   iproute2            ip/rdma, network namespaces, bridge and taps
packages=(qemu-system-x86 linux-image-amd64 busybox-static rdma-core ibverbs-providers
  ibverbs-utils rdmacm-utils perftest libibverbs-dev librdmacm-dev libclang-dev pkg-config
  iproute2)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "==> installing Debian packages: ${missing[*]}"
  if [ "$(id -u)" != 0 ]; then
    echo "error: installing packages needs root (run as root, or install: ${missing[*]})" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

if ! command -v cargo >/dev/null; then
  echo "error: cargo not found; install the Rust toolchain (https://rustup.rs) and retry" >&2
  exit 1
fi

# vhost-device-vsock (crates.io) serves the test bed's vsock devices: the host kernel has no
# vhost-vsock, and its UNIX socket speaks Cloud Hypervisor's hybrid vsock protocol (~3 min).
VHOST_DEVICE_VSOCK_VERSION=0.3.0
if ! command -v vhost-device-vsock >/dev/null; then
  echo "==> installing vhost-device-vsock $VHOST_DEVICE_VSOCK_VERSION (crates.io)"
  cargo install vhost-device-vsock --version "$VHOST_DEVICE_VSOCK_VERSION" --locked
fi

echo "==> building (release)"
cargo build --release --workspace --bins
