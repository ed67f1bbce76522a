#!/bin/sh
# What the test guests need, on a Debian 12 host (as root):
#   - the guest kernel: Debian's linux-image-<ABI>-amd64, of which only
#     /boot/vmlinuz-<ABI>-amd64 is extracted into BUILD_DIR/guest-kernel/ (the
#     host does not boot it, so it is not installed);
#   - the matching linux-headers-<ABI>-amd64, to build guest-driver/pvgpu.ko;
#   - busybox-static for the guests' initramfs, SeaBIOS and QEMU's option
#     ROMs (linuxboot) for direct kernel boot.
# The ABI is $PVGPU_GUEST_KERNEL if set, else the one whose headers are
# already installed, else what Debian's linux-image-amd64 points to now.
# Idempotent: a second run downloads nothing.
#   usage: tests/vm/setup-guest.sh [BUILD_DIR]
set -eu
cd "$(dirname "$0")/../.."
build=${1:-build}
out="$build/guest-kernel"
mkdir -p "$out"

log() { printf 'setup-guest: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }
installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q 'install ok installed'; }
updated=0
apt_update() {
    [ $updated = 1 ] && return 0
    log "apt-get update"
    apt-get update -qq
    updated=1
}
apt_install() {
    missing=""
    for p in "$@"; do installed "$p" || missing="$missing $p"; done
    [ -n "$missing" ] || return 0
    [ "$(id -u)" = 0 ] || die "missing packages:$missing; run as root (or: sudo apt-get install$missing)"
    apt_update
    log "installing$missing"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing
}

apt_install busybox-static seabios qemu-system-data cpio

kver=${PVGPU_GUEST_KERNEL:-}
if [ -z "$kver" ] && [ -f "$out/version" ]; then
    kver=$(cat "$out/version")
fi
if [ -z "$kver" ]; then
    kver=$(ls -d /usr/src/linux-headers-*-amd64 2>/dev/null | sed 's|.*/linux-headers-||' | sort -V | tail -n1)
fi
if [ -z "$kver" ]; then
    apt_update
    kver=$(apt-cache depends linux-image-amd64 2>/dev/null |
           sed -n 's/^ *Depends: linux-image-\([0-9].*-amd64\)$/\1/p' | head -n1)
    [ -n "$kver" ] || die "cannot tell the current Debian kernel ABI from linux-image-amd64"
fi
log "guest kernel $kver"

apt_install "linux-headers-$kver"

if [ ! -s "$out/vmlinuz-$kver" ]; then
    [ "$(id -u)" = 0 ] || die "the guest kernel is missing; run as root to download it"
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    log "downloading linux-image-$kver (only vmlinuz is kept)"
    (cd "$tmp" && apt-get download -qq "linux-image-$kver" 2>/dev/null) ||
        { apt_update; (cd "$tmp" && apt-get download -qq "linux-image-$kver"); } ||
        die "apt-get download linux-image-$kver failed"
    dpkg-deb --fsys-tarfile "$tmp"/linux-image-*.deb |
        tar -x -C "$tmp" "./boot/vmlinuz-$kver" || die "no vmlinuz in linux-image-$kver"
    mv "$tmp/boot/vmlinuz-$kver" "$out/vmlinuz-$kver"
fi
printf '%s\n' "$kver" > "$out/version"
ln -sfn "vmlinuz-$kver" "$out/vmlinuz"
log "done: $out/vmlinuz-$kver, /usr/src/linux-headers-$kver"
