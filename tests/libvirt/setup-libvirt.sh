#!/bin/sh
# What the libvirt tests need on a Debian 12 host (as root): libvirtd and
# virtlogd (libvirt-daemon, with its QEMU driver), virsh, and pkill (procps,
# not in a minimal Debian) to stop QEMUs a stopped libvirtd left behind.  Nothing is
# configured or started system-wide: each test runs its own session-mode
# libvirtd as the user nobody, with its state in a temporary directory.
# Idempotent.  usage: tests/libvirt/setup-libvirt.sh
set -eu
log() { printf 'setup-libvirt: %s\n' "$*" >&2; }
installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q 'install ok installed'; }
missing=""
for p in libvirt-daemon libvirt-daemon-driver-qemu libvirt-clients procps; do
    installed "$p" || missing="$missing $p"
done
[ -n "$missing" ] || exit 0
if [ "$(id -u)" != 0 ]; then
    log "missing packages:$missing; run as root (or: sudo apt-get install$missing)"
    exit 1
fi
log "apt-get update"
apt-get update -qq
log "installing$missing"
# No recommends: neither dnsmasq nor a system libvirtd service are wanted.
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing
