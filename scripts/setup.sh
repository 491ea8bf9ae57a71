#!/usr/bin/env bash
# Installs what rdmamig needs on a fresh Debian 12 machine and builds the workspace.
# Idempotent: packages already present are not reinstalled. Needs root (apt, namespaces).
set -euo pipefail
cd "$(dirname "$0")/.."

# No step fails silently: whatever command stops this script is named, with its line.
trap 'echo "error: scripts/setup.sh stopped at line $LINENO: \"$BASH_COMMAND\" exited with status $?" >&2' ERR

if ! command -v cargo >/dev/null; then
  echo "error: cargo not found on PATH; install the Rust toolchain (https://rustup.rs), open a" \
    "new shell (or run: . \"\$HOME/.cargo/env\") and retry" >&2
  exit 1
fi

# What each package is for:
#   ca-certificates     HTTPS to crates.io (cargo) and to apt mirrors
#   gcc libc6-dev       the linker rustc calls, and the C that ring and rdma-sys build
#   g++                 libFuzzer's C++, which the fuzz targets link (scripts/fuzz.sh)
#   linux-image-amd64   the guest kernel with Soft-RoCE (rdma_rxe), rdma_cm and uverbs
#   xz-utils            takes the ELF kernel out of its XZ bzImage, for QEMU's fast PVH boot
#   busybox-static      the guest initramfs userland
#   rdma-core ibverbs-providers libibverbs-dev librdmacm-dev
#                       libibverbs/librdmacm and the rxe provider (guest) and headers (build)
#   ibverbs-utils rdmacm-utils perftest
#                       ibv_devinfo, rping, ib_send_* in the guest for checks and baselines
#   libclang-dev pkg-config   bindgen for rdma-sys
#   iproute2            ip/rdma, network namespaces, bridge and taps
packages=(ca-certificates gcc g++ libc6-dev linux-image-amd64 xz-utils busybox-static rdma-core ibverbs-providers
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

# qemu-system-x86 runs the test-bed VMs (TCG) and their QMP, hot-plug and migration.
# The test bed needs QEMU 10: bookworm's QEMU 7.2 now and then delivers a TCG-migrated guest
# whose kernel memory is damaged (docs/testbed.md), which no RDMA test can tell apart from a
# lost message. bookworm-backports carries 10.0; only QEMU is taken from it.
QEMU_MIN_MAJOR=10
# Prints QEMU's major version, or nothing when there is no QEMU (never fails: under
# `set -e -o pipefail` a missing binary would otherwise end the script here, silently).
qemu_major() {
  command -v qemu-system-x86_64 >/dev/null || return 0
  qemu-system-x86_64 --version 2>/dev/null |
    sed -n 's/^QEMU emulator version \([0-9]*\)\..*/\1/p' || true
}
found=$(qemu_major)
if [ -z "$found" ] || [ "$found" -lt "$QEMU_MIN_MAJOR" ]; then
  echo "==> installing QEMU $QEMU_MIN_MAJOR from bookworm-backports (found: ${found:-none})"
  if [ "$(id -u)" != 0 ]; then
    echo "error: installing QEMU needs root (run as root)" >&2
    exit 1
  fi
  if ! grep -rqs "bookworm-backports" /etc/apt/sources.list /etc/apt/sources.list.d/; then
    printf '%s\n' "Types: deb" "URIs: http://deb.debian.org/debian" \
      "Suites: bookworm-backports" "Components: main" \
      "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg" \
      >/etc/apt/sources.list.d/rdmamig-bookworm-backports.sources
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q --no-install-recommends -t bookworm-backports qemu-system-x86
  found=$(qemu_major)
  if [ -z "$found" ] || [ "$found" -lt "$QEMU_MIN_MAJOR" ]; then
    echo "error: QEMU $QEMU_MIN_MAJOR was not installed (found: ${found:-none})" >&2
    exit 1
  fi
fi

# vhost-device-vsock (crates.io) serves the test bed's vsock devices: the host kernel has no
# vhost-vsock, and its UNIX socket speaks Cloud Hypervisor's hybrid vsock protocol (~3 min).
VHOST_DEVICE_VSOCK_VERSION=0.3.0
if ! command -v vhost-device-vsock >/dev/null; then
  echo "==> installing vhost-device-vsock $VHOST_DEVICE_VSOCK_VERSION (crates.io)"
  cargo install vhost-device-vsock --version "$VHOST_DEVICE_VSOCK_VERSION" --locked
  if ! command -v vhost-device-vsock >/dev/null; then
    echo "error: vhost-device-vsock was installed into ${CARGO_HOME:-$HOME/.cargo}/bin, which is" \
      "not on PATH; add it to PATH (rustup's \$HOME/.cargo/env does) and retry" >&2
    exit 1
  fi
fi

echo "==> building (release)"
# --lib builds librdmamig_preload.so too (a cdylib, which --bins alone leaves out).
cargo build --release --workspace --bins --lib
