#!/usr/bin/env bash
# Proves the README's two commands on a bare Debian 12 machine: builds a clean Debian 12 root
# with debootstrap, puts a clean export of HEAD in it (`git archive`: nothing uncommitted),
# lends it the host's Rust toolchain read-only and nothing else of the host, and runs
# `scripts/demo.sh`, then `scripts/test.sh`, inside it as root. Fails unless the demo printed
# its timelines and its side-by-side switching times, and the tests passed.
#
# What a run can reuse: only debootstrap's own output, cached as a tarball, never anything that
# setup.sh installed or built; each run starts from that pristine root again, so every run
# proves the cold path (apt, cargo's downloads, the whole build).
#
# The root runs in private mount and PID namespaces: its mounts (/proc, /sys, /dev, /run, the
# toolchain) vanish with it, and every process started inside it (QEMU, the daemon, the test
# bed's namespaces' holders) ends when it does, even when a step fails.
#
# Needs root, and the network the package registries are on. Takes about 35 minutes on
# 2 cores (docs/testbed.md has the measured figures).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)

usage() {
  cat <<'EOF'
usage: scripts/fresh-check.sh [--work-dir DIR] [--keep] [--demo-only]

Runs the README's two commands (scripts/demo.sh, then scripts/test.sh) on a clean Debian 12
root made by debootstrap, with a `git archive` of HEAD and the host's Rust toolchain
(read-only) and nothing else of the host.

  --work-dir DIR  where the root and the logs go (default: /var/tmp/rdmamig-fresh-check);
                  the pristine debootstrap tarball is cached there too
  --keep          keep the root afterwards, to look inside (it is several GB)
  --demo-only     run the demo command only, not the tests

Environment: RDMAMIG_DEBIAN_MIRROR (default http://deb.debian.org/debian).
Logs: <work-dir>/demo.log and <work-dir>/test.log.
EOF
}

work=/var/tmp/rdmamig-fresh-check
keep=false
demo_only=false
while [ $# -gt 0 ]; do
  case "$1" in
    --work-dir) work=${2:?--work-dir needs a directory}; shift 2 ;;
    --keep) keep=true; shift ;;
    --demo-only) demo_only=true; shift ;;
    -h|--help) usage; exit 0 ;;
    --inside) shift; break ;;
    *) echo "error: unknown option $1" >&2; usage >&2; exit 2 ;;
  esac
done
mirror=${RDMAMIG_DEBIAN_MIRROR:-http://deb.debian.org/debian}
root=$work/root
mark() { printf '==> [fresh-check %s] %s\n' "$(date -u +%H:%M:%S)" "$*"; }

# --- inside the private namespaces: mount, chroot, run one README command ------------------
if [ "${1:-}" = demo ] || [ "${1:-}" = tests ]; then
  what=$1 toolchain=$2 shared=$3
  # The root must be a mount point of its own, as / is on a machine: `ip netns exec` makes
  # "/" a slave mount, which fails on a plain directory.
  mount --bind "$root" "$root"
  mount -t proc proc "$root/proc"
  mount --rbind /sys "$root/sys"
  mount --rbind /dev "$root/dev"
  mount -t tmpfs -o mode=0755 tmpfs "$root/run"
  mkdir -p "$root$toolchain" "$root/work/shared"
  mount --bind "$toolchain" "$root$toolchain"
  mount -o remount,bind,ro "$root$toolchain"
  mount --bind "$shared" "$root/work/shared"
  mount -o remount,bind,ro "$root/work/shared"
  case "$what" in
    demo) command=scripts/demo.sh ;;
    tests) command=scripts/test.sh ;;
  esac
  # BASH_ENV makes every bash script the command runs name the command that failed and
  # where, even a script that would stop silently (set -e ends a script without a word).
  printf '%s\n' "trap 'echo \"fresh-check: \$0 line \$LINENO: \\\"\$BASH_COMMAND\\\" exited with status \$?\" >&2' ERR" \
    >"$root/etc/rdmamig-fresh-check-errtrace.sh"
  exec chroot "$root" /usr/bin/env -i HOME=/root LANG=C.UTF-8 TERM=dumb \
    BASH_ENV=/etc/rdmamig-fresh-check-errtrace.sh \
    PATH="/root/.cargo/bin:$toolchain/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
    bash -c "cd /work/main && exec $command"
fi

# --- outside: prepare the root, run both commands, judge them -------------------------------
if [ "$(id -u)" != 0 ]; then
  echo "error: the fresh-machine check needs root (debootstrap, chroot, namespaces)" >&2
  exit 1
fi
if ! git -C "$repo" rev-parse --verify -q HEAD >/dev/null; then
  echo "error: $repo is not a git work tree with a commit; the check exports HEAD" >&2
  exit 1
fi
shared=$(cd "$repo/.." && pwd)/shared
if [ ! -d "$shared" ]; then
  echo "error: $shared is missing; the tests read ../shared (DESIGN.md, the CH spec)" >&2
  exit 1
fi
if ! command -v rustup >/dev/null || ! toolchain_cargo=$(rustup which cargo 2>/dev/null); then
  echo "error: no rustup toolchain on the host; the check lends the host's toolchain to the" \
    "clean root" >&2
  exit 1
fi
toolchain=$(dirname "$(dirname "$toolchain_cargo")")
for tool in debootstrap unshare chroot; do
  if ! command -v "$tool" >/dev/null; then
    mark "installing debootstrap on the host (the check's only host package)"
    DEBIAN_FRONTEND=noninteractive apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends debootstrap
    break
  fi
done

mkdir -p "$work"
started=$(date +%s)
# A root left by an earlier run (--keep, or a crash) is removed first. Its mounts lived in a
# namespace of its own, so nothing of the host is mounted under it.
if grep -qF " $root/" /proc/self/mountinfo; then
  echo "error: something is mounted under $root; unmount it first" >&2
  exit 1
fi
rm -rf "$root"

pristine=$work/debootstrap-bookworm-minbase.tar
if [ ! -s "$pristine" ]; then
  mark "debootstrap: a minimal Debian 12 root from $mirror (cached for later runs)"
  rm -rf "$work/debootstrap.partial"
  if ! debootstrap --variant=minbase bookworm "$work/debootstrap.partial" "$mirror" \
    >"$work/debootstrap.log" 2>&1; then
    tail -n 30 "$work/debootstrap.log" >&2
    echo "error: debootstrap failed (log: $work/debootstrap.log)" >&2
    exit 1
  fi
  tar -C "$work/debootstrap.partial" -cf "$pristine.partial" .
  mv "$pristine.partial" "$pristine"
  rm -rf "$work/debootstrap.partial"
fi
mark "a clean root from the pristine debootstrap output"
mkdir -p "$root"
tar -C "$root" -xf "$pristine"

# What a fresh Debian 12 machine has beyond debootstrap's minimal root: its usual apt sources,
# a resolver, and the Rust toolchain (lent read-only at its host path, put first on PATH; a
# fresh ~/.cargo for cargo's registry and `cargo install`, as rustup leaves it).
printf '%s\n' "Types: deb" "URIs: $mirror" "Suites: bookworm bookworm-updates" \
  "Components: main" "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg" "" \
  "Types: deb" "URIs: ${mirror%/debian}/debian-security" "Suites: bookworm-security" \
  "Components: main" "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg" \
  >"$root/etc/apt/sources.list.d/debian.sources"
rm -f "$root/etc/apt/sources.list"
cp -L /etc/resolv.conf "$root/etc/resolv.conf"
# Every machine of this workplace trusts the CA its network's TLS goes through, installed
# where a local administrator puts one. The root gets those (and nothing else of the host's
# trust), so that its own ca-certificates, once setup.sh installs it, trusts them too.
if [ -d /usr/local/share/ca-certificates ]; then
  mkdir -p "$root/usr/local/share/ca-certificates"
  cp -r /usr/local/share/ca-certificates/. "$root/usr/local/share/ca-certificates/"
fi
# No service starts inside the chroot (there is no init to own it).
printf '#!/bin/sh\nexit 101\n' >"$root/usr/sbin/policy-rc.d"
chmod 755 "$root/usr/sbin/policy-rc.d"
mkdir -p "$root/root/.cargo/bin" "$root/work/main"
git -C "$repo" archive --format=tar HEAD | tar -C "$root/work/main" -xf -
mark "HEAD is $(git -C "$repo" rev-parse --short HEAD); toolchain $toolchain (read-only)"

# Runs one README command in the root; its output goes to the terminal and to a log.
run_inside() {
  local what=$1 log=$2
  set +e
  unshare --mount --pid --fork --propagation private -- \
    "$repo/scripts/fresh-check.sh" --work-dir "$work" --inside "$what" "$toolchain" "$shared" \
    2>&1 | tee "$log"
  local status=${PIPESTATUS[0]}
  set -e
  return "$status"
}

cleanup() {
  if [ "$keep" = false ] && ! grep -qF " $root/" /proc/self/mountinfo; then
    rm -rf "$root"
  fi
}
trap cleanup EXIT

failed=()
mark "the demo command: scripts/demo.sh"
t0=$(date +%s)
if run_inside demo "$work/demo.log"; then
  for want in "timeline:" "== side by side ==" "switching time at the peer"; do
    grep -qF "$want" "$work/demo.log" || failed+=("the demo's output has no \"$want\"")
  done
else
  failed+=("scripts/demo.sh exited with status $?")
fi
mark "the demo command took $(($(date +%s) - t0)) s"

if [ "$demo_only" = false ]; then
  mark "the test command: scripts/test.sh"
  t0=$(date +%s)
  run_inside tests "$work/test.log" || failed+=("scripts/test.sh exited with status $?")
  mark "the test command took $(($(date +%s) - t0)) s"
fi

mark "the whole check took $(($(date +%s) - started)) s"
if [ ${#failed[@]} -gt 0 ]; then
  echo "FRESH-MACHINE CHECK FAILED on a clean Debian 12 root:" >&2
  printf '  - %s\n' "${failed[@]}" >&2
  echo "  logs: $work/demo.log, $work/test.log" >&2
  exit 1
fi
if [ "$demo_only" = true ]; then
  echo "fresh-machine check passed: the demo ran on a clean Debian 12 root (tests not run: --demo-only)"
else
  echo "fresh-machine check passed: the demo and the tests ran on a clean Debian 12 root"
fi
